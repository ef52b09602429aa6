"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from ft import LLM, SamplingParams
from ft.layers.sampler import Sampler, sample_row
from tests.checkpoints import write_checkpoint


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert all(sample_row(logits, params, i, gen) == int(logits.argmax()) for i in range(20))


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 2.8, -5.0, -5.0, -6.0])
    gen = torch.Generator().manual_seed(2)
    seen_k = {sample_row(logits, SamplingParams(temperature=5.0, top_k=2), i, gen) for i in range(200)}
    assert seen_k == {0, 1}
    # the first three tokens hold ~99.9% of the mass: top_p 0.99 never samples the tail
    seen_p = {sample_row(logits, SamplingParams(temperature=1.0, top_p=0.99), i, gen) for i in range(300)}
    assert seen_p == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    gen = torch.Generator().manual_seed(3)
    draws = [sample_row(logits, SamplingParams(temperature=1.0), i, gen) for i in range(3000)]
    freq = [draws.count(t) / len(draws) for t in range(3)]
    assert all(abs(f - p) < 0.04 for f, p in zip(freq, (0.6, 0.3, 0.1)))


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=1.0)
    a = Sampler(torch.device("cpu"), 0)(logits[:1], [seeded], [5])[0].token_id
    b = Sampler(torch.device("cpu"), 99)(logits, [seeded, other, other, other], [5, 0, 0, 0])[0].token_id
    assert a == b


def test_logprobs_are_raw_and_include_the_chosen_token():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5))
    res = Sampler(torch.device("cpu"), 0)(logits, [SamplingParams(temperature=2.0, logprobs=3)], [0])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert res.token_id in res.logprobs and 3 <= len(res.logprobs) <= 4
    assert all(math.isclose(v, float(raw[k]), abs_tol=1e-6) for k, v in res.logprobs.items())


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=float("nan")),
        dict(top_k=-2),
        dict(max_tokens=-1),
        dict(temperature=float("inf")),
    ],
)
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_engine_seed_reproducible_and_stop_tokens(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", seed=2)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
        a, b = llm.generate([[1, 2, 3], [1, 2, 3]], [p, p])
        assert a.token_ids == b.token_ids
        stop = a.token_ids[4]
        first = a.token_ids.index(stop)
        c = llm.generate(
            [[1, 2, 3]], SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop_token_ids=[stop])
        )[0]
        assert c.token_ids == a.token_ids[: first + 1] and c.finish_reason == "stop"
        assert a.finish_reason == "length" and len(a.token_ids) == 12
