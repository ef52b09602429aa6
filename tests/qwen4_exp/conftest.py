"""Fixtures for the qwen4_exp engine tests: tiny random checkpoints written by the in-suite
oracle's writer (tests/reference), the oracle's float64 weights, and prompts long enough that
QSA is sparse (40 tokens in blocks of 4 is 10 blocks; a query reads at most 1 + Lc + K = 5)."""

from __future__ import annotations

import pytest
import torch

from ft import LLM, SamplingParams
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint
from tests.reference.qwen4_exp_ref import load_checkpoint

_gen = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(1, 128, (n,), generator=_gen).tolist() for n in (40, 37, 45)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def generate(path, prompts, params, **options):
    with LLM(model=str(path), device="cpu", dtype="float32", progress=False, **options) as llm:
        return llm.generate(prompts, params)


def max_logprob_gap(a, b) -> float:
    """Largest |difference| over the prompt and sampled log-probs of two runs with equal tokens."""
    gap = 0.0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for da, db in zip(
            (x.prompt_logprobs or [None])[1:] + (x.logprobs or []),
            (y.prompt_logprobs or [None])[1:] + (y.logprobs or []),
        ):
            assert da.keys() == db.keys()
            gap = max(gap, max(abs(da[k] - db[k]) for k in da))
    return gap


def prompt_gaps(out, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|engine - oracle| of every prompt token's log-prob; ``ref_logprobs`` [T, V] from the oracle."""
    ids = out.prompt_token_ids
    pairs = zip(out.prompt_logprobs[1:], ids[1:])
    return torch.tensor([abs(d[t] - float(ref_logprobs[i, t])) for i, (d, t) in enumerate(pairs)])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(checkpoint dir, oracle weights, config) of the tiny model with QSA, PLE and hc_mult 2."""
    path = tmp_path_factory.mktemp("qwen4_exp_tiny")
    write_qwen4_exp_checkpoint(path, tiny_qwen4_exp_config(), seed=0)
    weights, config = load_checkpoint(path)
    return path, weights, config
