"""A lean host store: experts [0, R) of every layer only in their GPU cache slots, the host store
holding the other E - R (``ft.moe.backends.placement``).

fp32 on CPU, tiny random qwen3_next and qwen3_moe checkpoints (8 experts, top-2): R forced to 1,
E/2 and E - k gives exactly the resident backend's outputs (prefill, decode, chunked prefill,
prefetch on and off, lru and lfu, device-to-device staging, hybrid), TP=2 equals TP=1, loading
and dummy initialisation write each expert once where it lives, the host size picks R, and what
cannot work is refused before loading, with the figures.
"""

from __future__ import annotations

import pytest
import torch

import ft.engine.model_runner as model_runner
from ft.moe.backends.runtime import moe_blocks
from tests.checkpoints import write_checkpoint
from tests.offload.equality import PARAMS, PROMPTS, assert_same, engine, generate

E = 8
CASES = {  # slots = round(fraction * 8); static + dynamic
    "R1-1-dynamic-no-prefetch": dict(static_experts=1, expert_cache_fraction=0.25, moe_prefetch=False),
    "R1-3-dynamic-staging-2": dict(static_experts=1, expert_cache_fraction=0.5, moe_staging_experts=2),
    "R4-2-dynamic-lfu-d2d": dict(
        static_experts=4,
        expert_cache_fraction=0.75,
        expert_cache_policy="lfu",
        moe_prefill_hit_d2d=True,
        moe_staging_experts=3,
    ),
    "R6-all-slots": dict(static_experts=6),  # E - k static, the 2 others in 2 dynamic slots
    "hybrid-R4-1-dynamic": dict(moe_backend="hybrid", static_experts=4, expert_cache_fraction=0.625),
    "hybrid-R1-no-prefetch": dict(
        moe_backend="hybrid", static_experts=1, expert_cache_fraction=0.5, moe_prefetch=False
    ),
}


def options(case: str) -> dict:
    return {"moe_backend": "offload", **CASES[case]}


@pytest.mark.parametrize("case", list(CASES))
def test_lean_equals_resident(ckpt, refs, case):
    outs, s = generate(ckpt, **options(case))
    assert_same(outs, refs[8192])
    r = CASES[case]["static_experts"]
    assert s.moe_resident >= s.moe_layers * r and s.moe_hits > 0  # static experts: resident, hits
    if case == "R6-all-slots":  # nothing to evict: the two dynamic slots hold the two others
        assert s.moe_evictions == 0 and s.moe_resident == s.moe_layers * E


@pytest.mark.parametrize("case", ["R1-1-dynamic-no-prefetch", "R4-2-dynamic-lfu-d2d", "hybrid-R4-1-dynamic"])
def test_lean_chunked_prefill_equals_resident(ckpt, refs, case):
    outs, _ = generate(ckpt, max_num_batched_tokens=5, **options(case))
    assert_same(outs, refs[5])


def runner(llm):
    return llm.engine.executor.runner


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_each_expert_loads_once_where_it_lives(ckpt, load_format):
    """Static experts in their slots, the others in host rows e - R, bit for bit the resident
    bank's, for checkpoint and dummy weights alike; the bank keeps no copy of its own."""
    with engine(ckpt, load_format=load_format, moe_backend="gpu") as llm:
        want = [b.experts.expert_weights() for b in moe_blocks(runner(llm).model)]
        want = [{name: t.clone() for name, t in bank.items()} for bank in want]
    r = 3
    with engine(ckpt, load_format=load_format, moe_backend="offload", static_experts=r) as llm:
        moe = runner(llm).moe
        assert len(moe.stores) == len(moe.caches) == len(want)
        for store, cache, bank in zip(moe.stores, moe.caches, want):
            assert store.block.shape[0] == E - r and store.static == r
            assert store.nbytes == (E - r) * store.layout.expert_bytes
            assert cache.map.static == r and cache.table[:r].tolist() == list(range(r))
            for name, w in bank.items():
                assert torch.equal(cache.tensors[name][:r], w[:r]), name
                assert torch.equal(store.tensors[name], w[r:]), name
        w13 = moe_blocks(runner(llm).model)[-1].experts.w13
        assert w13.is_meta and w13.placed.row(r).data_ptr() == store.tensors["w13"][0].data_ptr()
        assert moe.plan.host_bytes == sum(s.nbytes for s in moe.stores)
        line = moe.describe(16)
        assert f"{E}/{E} experts resident (100%; {r} static + {E - r} dynamic slots)" in line
        assert f"host store {moe.plan.host_bytes / 2**30:.2f} GiB of {E - r} experts a layer" in line


def test_the_host_size_picks_the_static_experts(ckpt, refs):
    """A host that holds 5 experts of each layer (the headroom rule of check_host_memory) gets
    R = 3; a host that holds them all gets none."""
    with engine(ckpt, moe_backend="offload") as llm:
        assert runner(llm).moe.static == 0
        per_expert = sum(s.layout.expert_bytes for s in runner(llm).moe.stores)  # every layer's
    limit = 5 * per_expert * 10 // 9 + 9  # 0.9 of it (the host minus headroom) holds 5 experts
    with engine(ckpt, moe_backend="offload", max_host_memory=limit) as llm:
        moe = runner(llm).moe
        assert moe.static == 3 and all(st.block.shape[0] == 5 for st in moe.stores)
        assert moe.plan.slots == E and moe.plan.static == 3
        assert_same(llm.generate(PROMPTS, PARAMS), refs[8192])


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_tp2_lean_equals_tp1(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("FT_MOE_HOST_READS", "1")  # the spawned ranks read it (on by default)
    write_checkpoint(tmp_path, "qwen3_next", seed=2, num_key_value_heads=4)
    want, _ = generate(tmp_path, moe_backend="gpu")
    got, s = generate(
        tmp_path,
        tp_size=2,
        moe_backend=backend,
        static_experts=3,
        expert_cache_fraction=0.5,
        moe_staging_experts=3,
    )
    assert_same(got, want, tol=1e-5)
    assert s.moe_backend == backend and s.moe_resident >= 3 * s.moe_layers and s.moe_bytes_h2d > 0
    # offload decodes with host reads (on by default): static experts in their slots, the rest
    # read in place from each rank's shard of the host store
    assert (s.moe_bytes_host_read > 0) == (backend == "offload")


@pytest.fixture
def no_loading(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("weights were read before the plan was checked")

    monkeypatch.setattr(model_runner, "load_weights", never)


@pytest.mark.parametrize(
    "opts,error,match",
    [
        (dict(max_host_memory="4KiB"), MemoryError, r"offloaded experts need .* GiB of host memory"),
        (dict(static_experts=0, max_host_memory="64KiB"), MemoryError, r"need .*--max-host-memory$"),
        (dict(moe_backend="cpu", static_experts=2), ValueError, r"cpu backend computes every routed"),
        (dict(moe_backend="cpu", max_host_memory="64KiB"), MemoryError, r"cpu backend needs them all"),
        (dict(static_experts=E), ValueError, r"has 8 experts and at least one must stay dynamic"),
        (dict(static_experts=4, expert_cache_fraction=0.5), ValueError, r"4 slots per layer, no more"),
    ],
    ids=["host-too-small", "lean-off", "cpu-static", "cpu-host", "all-static", "no-dynamic-slot"],
)
def test_what_cannot_work_is_refused_before_loading(tmp_path, no_loading, opts, error, match):
    write_checkpoint(tmp_path, "qwen3_moe", seed=3)
    with pytest.raises(error, match=match):
        engine(tmp_path, **({"moe_backend": "offload"} | opts))


def test_the_plan_line_gives_the_gdn_state_pool(ckpt, capsys):
    """An offloading GDN model's plan line says what its state rows (a request slot and a prefix
    snapshot each) take, since the expert cache gets what they leave; a model without GDN layers
    says nothing of them."""
    with engine(ckpt, moe_backend="offload", expert_cache_fraction=0.5, max_running_requests=3) as llm:
        plan, gdn = runner(llm).plan, runner(llm).gdn_layers
        line = [t for t in capsys.readouterr().out.splitlines() if "experts resident" in t][-1]
    rows = 3 + 1 + plan.num_snapshots
    if gdn:
        assert f"GDN states {plan.state_bytes / 2**30:.2f} GiB in {rows} rows" in line
    else:
        assert "GDN states" not in line
