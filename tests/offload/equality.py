"""What the equality tests of the offloading backends share: the prompts (different lengths, so
decode batches shrink from three sequences to one, which fits two slots), an engine on the CPU
in fp32, and the comparison with the resident backend's outputs (exact unless told otherwise)."""

from __future__ import annotations

from ft import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19], [8, 8, 2, 91, 40, 3, 3]]
PARAMS = [
    SamplingParams(max_tokens=n, temperature=0.0, prompt_logprobs=2, logprobs=2, ignore_eos=True)
    for n in (9, 3, 6)
]


def engine(path, **options) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", progress=False, **options)


def generate(path, **options):
    with engine(path, **options) as llm:
        return llm.generate(PROMPTS, PARAMS), llm.engine.stats()


def assert_same(outs, ref, tol: float = 0.0):
    for got, want in zip(outs, ref, strict=True):
        assert got.token_ids == want.token_ids
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs[1:] + got.logprobs, want.prompt_logprobs[1:] + want.logprobs):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol for k in a)
