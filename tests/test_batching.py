"""Batched equals alone; chunked prefill equals one-shot; a pool too small for everyone still
finishes every request with the same tokens (preemption and recompute)."""

from __future__ import annotations

import pytest

from ft import LLM, SamplingParams
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
