"""Sampling at the edges of its knobs, against what vLLM does there: temperatures too small to
divide by, and the order of min-p and top-p."""

from __future__ import annotations

import pytest
import torch

from ft import SamplingParams
from ft.layers.sampler import Sampler

CPU = torch.device("cpu")


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40])
@pytest.mark.parametrize("seed", [None, 3])
def test_a_temperature_below_epsilon_is_greedy(temperature, seed):
    """vLLM samples greedily below a temperature of 1e-5; dividing by 1e-40 instead overflows the
    logits to inf, their softmax to NaN, and the race picked token 0 whatever the model said."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 3
    logits[:, 0] = -10.0  # token 0 is the least likely: NaN's argmax would pick it
    params = SamplingParams(temperature=temperature, seed=seed, top_k=5, min_p=0.1)
    got = [r.token_id for r in Sampler(CPU, 0)(logits, [params] * 8, list(range(8)))]
    assert got == logits.argmax(-1).tolist()
    assert params.greedy
    assert not SamplingParams(temperature=1e-5).greedy  # vLLM's epsilon itself samples
