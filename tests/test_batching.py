"""Batched equals alone; chunked prefill equals one-shot; a pool too small for everyone still
finishes every request with the same tokens (preemption and recompute)."""

from __future__ import annotations

import pytest

from ft import LLM, SamplingParams
from ft.utils import cdiv
from tests.checkpoints import write_checkpoint

PROMPTS = [
    [5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7, 8, 9, 10, 11, 12, 40],
    [30, 1, 64, 19],
    [2, 90, 45, 45, 45, 3, 11],
    [77],
]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("next")
    write_checkpoint(path, "qwen3_next", seed=3)
    return path


def generate(path, prompts, **options):
    with LLM(model=str(path), device="cpu", dtype="float32", progress=False, block_size=4, **options) as llm:
        return llm.generate(prompts, PARAMS)


def assert_same(a, b, tol=1e-5):
    assert a.token_ids == b.token_ids
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
    for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[k] - y[k]) < tol for k in x)


@pytest.fixture(scope="module")
def alone(ckpt):
    return [generate(ckpt, [p])[0] for p in PROMPTS]


def test_batched_equals_alone(ckpt, alone):
    for got, want in zip(generate(ckpt, PROMPTS), alone):
        assert_same(got, want)


@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_prefill_equals_one_shot(ckpt, alone, chunk):
    # fp32 matmuls of other shapes sum in another order: agreement to a few 1e-6 relative
    for got, want in zip(generate(ckpt, PROMPTS, max_num_batched_tokens=chunk), alone):
        assert_same(got, want, tol=5e-5)


def test_prompt_logprobs_in_slices_equal_one_shot(ckpt, alone, monkeypatch):
    """The runner computes prompt log-probs a few rows at a time (``PROMPT_LOGPROB_BYTES``: 3 rows
    here) inside a whole chunk: every prompt position still gets the log-probs of one shot, no
    logits call takes more than 3 rows, and each prompt is still one forward."""
    from ft.engine import prompt_logprobs

    # tests/checkpoints.py: 96 tokens
    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGPROB_BYTES", 3 * 8 * 96)
    calls, compute = [], None

    def spy(self, hidden):
        calls.append(hidden.shape[0])
        return compute(self, hidden)

    with LLM(model=str(ckpt), device="cpu", dtype="float32", progress=False, block_size=4) as llm:
        model = llm.engine.executor.runner.model
        compute = type(model).compute_logits
        monkeypatch.setattr(type(model), "compute_logits", spy)
        for prompt, want in zip(PROMPTS, alone):
            calls.clear()
            assert_same(llm.generate([prompt], PARAMS)[0], want, tol=5e-5)
            prefill = cdiv(len(prompt) - 1, 3) + 1  # the prompt's rows with targets in 3s, then its last row
            assert max(calls) <= 3 and len(calls) == prefill + PARAMS.max_tokens - 1, calls


def test_small_pool_preempts_and_recomputes(ckpt, alone):
    # 12 blocks of 4 tokens: enough for the longest request (29 tokens) but not for all at once
    with LLM(
        model=str(ckpt), device="cpu", dtype="float32", progress=False, block_size=4, num_tokens=48
    ) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.stats().kv_blocks_free == 12  # free or cached-and-evictable
        assert llm.engine.scheduler.num_preemptions > 0
    for got, want in zip(outs, alone):
        assert_same(got, want)


def test_state_slots_limit_running(ckpt, alone):
    for got, want in zip(generate(ckpt, PROMPTS, max_running_requests=1), alone):
        assert_same(got, want)


def test_request_that_cannot_fit_is_refused(ckpt):
    with LLM(
        model=str(ckpt), device="cpu", dtype="float32", progress=False, block_size=4, num_tokens=16
    ) as llm:
        with pytest.raises(ValueError, match="KV cache"):
            llm.generate([list(range(1, 20))], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[]], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([[1, 2], [1, 10_000]], SamplingParams(max_tokens=4))
        assert not llm.engine.has_unfinished_requests()  # the good prompt was not left queued


def test_last_generated_token_needs_no_kv(ckpt):
    """A request holds its prompt and every generated token but the last in the KV cache (the last is
    sampled, never fed back): prompt 15 + 2 tokens fit a 16-token pool, with the tokens of a roomy
    one, and so does a prompt of 16 with one token; 16 + 2 does not."""
    prompt = [(7 * i + 3) % 90 + 1 for i in range(15)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", progress=False, block_size=4) as roomy:
        want = roomy.generate([prompt, prompt + [5]], [params, SamplingParams(max_tokens=1, temperature=0.0)])
    with LLM(
        model=str(ckpt), device="cpu", dtype="float32", progress=False, block_size=4, num_tokens=16
    ) as llm:
        got = llm.generate([prompt], params)[0]
        assert got.token_ids == want[0].token_ids and len(got.token_ids) == 2
        assert llm.generate([prompt + [5]], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids == (
            want[1].token_ids
        )
        with pytest.raises(ValueError, match="needs 17 tokens of KV cache"):
            llm.generate([prompt + [5]], params)


def test_more_logprobs_than_the_vocabulary_are_refused(ckpt):
    """A request asking more top log-probs than the vocabulary holds (96 tokens here) is refused
    when it is added: the sampler's top n once failed the whole step, every request in it."""
    good = SamplingParams(max_tokens=3, temperature=0.0, logprobs=96, prompt_logprobs=96)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", progress=False, block_size=4) as llm:
        for bad in (dict(logprobs=97), dict(prompt_logprobs=97)):
            with pytest.raises(ValueError, match=f"{next(iter(bad))}=97 is more than the vocabulary's 96"):
                llm.generate([PROMPTS[1], PROMPTS[0]], [good, SamplingParams(max_tokens=3, **bad)])
            assert not llm.engine.has_unfinished_requests()
        (out,) = llm.generate([PROMPTS[1]], good)
        assert len(out.token_ids) == 3 and all(len(lp) == 96 for lp in out.logprobs)
