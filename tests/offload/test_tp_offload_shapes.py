"""The offloading MoE backends under TP=2 on awkward shapes give exactly the resident backend's
outputs at TP=2 (fp32, CPU, gloo): each rank caches, streams and computes its own shard of every
expert, and the block's one reduce must see the sums the resident bank gives.

Shapes ``test_offload_engine.py`` leaves out: one cache slot a layer with prefetch on and off, a
first layer that is dense and attention, one expert a token (so that a prediction fits the one
slot), an intermediate width of 10 a rank and a shared expert 3 wide a rank; and NVFP4 banks at
the least width a rank allows (16) computed by the hybrid and cpu backends.
"""

from __future__ import annotations

import pytest

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint
from tests.offload.equality import assert_same

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12], [30, 1, 64, 19, 7]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, logprobs=2, ignore_eos=True)


def generate(path, **options):
    with LLM(model=str(path), tp_size=2, device="cpu", dtype="float32", progress=False, **options) as llm:
        return llm.generate(PROMPTS, PARAMS), llm.engine.stats()


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    write_checkpoint(
        path, "qwen3_next", seed=7, num_hidden_layers=4, mlp_only_layers=[0], intermediate_size=24,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts_per_tok=1, norm_topk_prob=False, moe_intermediate_size=20,
        shared_expert_intermediate_size=6, vocab_size=95,
    )  # fmt: skip
    return path, generate(path, moe_backend="gpu")[0]


@pytest.mark.parametrize("prefetch", [True, False])
def test_one_slot_a_layer_equals_resident(bf16, prefetch, request):
    """With prefetch, decode copies each layer's experts into its one slot (host reads off, so that
    the prefetch has a slot to fill); without, it reads the host store in place."""
    if prefetch:
        request.getfixturevalue("copying_decode")
    path, want = bf16
    got, stats = generate(path, moe_backend="offload", expert_cache_fraction=0.125, moe_prefetch=prefetch)
    assert_same(got, want)
    assert stats.moe_slots == 1 and stats.moe_layers == 3 and stats.moe_misses > 0
    assert (stats.moe_prefetched > 0) == prefetch


def test_nvfp4_banks_on_the_cpu_equal_resident(tmp_path):
    """NVFP4 experts 16 rows a rank (one scale block of down), two a token (hybrid's decode adds
    its hits' and misses' sums apart: exact only at two), one kv head on both ranks."""
    write_nvfp4_checkpoint(
        tmp_path, "qwen3_moe", seed=15, moe_intermediate_size=32, num_key_value_heads=1,
        mlp_only_layers=[1], vocab_size=93,
    )  # fmt: skip
    path = tmp_path / "nvfp4"
    want, _ = generate(path, moe_backend="gpu")
    for options in (dict(moe_backend="hybrid", expert_cache_fraction=0.125), dict(moe_backend="cpu")):
        got, stats = generate(path, **options)
        assert_same(got, want)
        assert stats.moe_backend == options["moe_backend"] and stats.moe_misses > 0
