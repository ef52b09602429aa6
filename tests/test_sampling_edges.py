"""Sampling at the edges of its knobs, against what vLLM does there: temperatures too small to
divide by, the order of min-p and top-p, and counts given as other types."""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize("seed", [None, 5])
def test_min_p_cuts_before_top_p_weighs(seed):
    """vLLM (v1) applies min-p after temperature and before top-k / top-p, so top-p weighs the
    min-p survivors' renormalised mass. Here min-p 0.3 keeps tokens 0-2 ([4, 3, 2] / 9); top-p 0.75
    then keeps 0 and 1 (4/9 < 0.75 <= 7/9). Top-p first, over the whole vocabulary, kept token 2
    too (0.4 + 0.3 < 0.75)."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    params = SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3, seed=seed)
    n = 4000
    picks = Sampler(CPU, 0)(probs.log().float().expand(n, -1), [params] * n, list(range(n)))
    counts = torch.bincount(torch.tensor([r.token_id for r in picks]), minlength=4).double()
    # the reference: min-p's cut, renormalise, then top-p's over the survivors
    kept = probs * (probs >= params.min_p * probs.max())
    kept = kept / kept.sum()
    ahead = kept.sort(descending=True)
    before = ahead.values.cumsum(0) - ahead.values  # the mass sorted ahead of each token
    top = torch.zeros_like(kept).index_put_((ahead.indices,), ahead.values * (before < params.top_p))
    want = top / top.sum()
    assert bool((counts[want == 0] == 0).all()), counts.tolist()
    sigma = (n * want * (1 - want)).sqrt()
    assert bool(((counts - n * want).abs() <= 5 * sigma + 1e-9).all()), (counts.tolist(), want.tolist())


@pytest.mark.parametrize(
    "field, value",
    [("top_k", 20.0), ("max_tokens", 8.5), ("min_tokens", 1.0), ("logprobs", 2.0), ("prompt_logprobs", True),
     ("seed", 3.7), ("max_tokens", "16")],
)  # fmt: skip
def test_an_integer_field_given_another_type_is_refused(field, value):
    """A count or seed that is not an integer is refused when the request is made, naming the field:
    ``top_k=20.0`` passed every range check and failed inside ``torch.topk`` during an engine step,
    taking down every request of that batch."""
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
    SamplingParams(**{field: 3})  # an int is taken (numpy's too)
    SamplingParams(**{field: np.int64(3)})
