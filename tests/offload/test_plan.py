"""The MoE plan without a GPU: which backend ``auto`` picks and how many slots a budget buys, for
the real Qwen3-Next-80B-A3B config (on the meta device), with the GPU's memory figures faked."""

from __future__ import annotations

import os

import pytest
import torch

import ft.moe.backends.runtime as runtime
import ft.moe.backends.sizing as sizing
from ft.config import EngineConfig
from ft.distributed import TPInfo, tp_context
from ft.models.config_json import load_model_config
from ft.moe.backends.host_store import host_experts
from ft.moe.backends.layout import ExpertLayout
from ft.moe.banks import BF16ExpertBank

NEXT_80B = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3_next_80b_a3b.json")
GiB = 1 << 30
CUDA = torch.device("cuda", 0)  # never touched: the memory figures are faked


@pytest.fixture(scope="module")
def mc():
    return load_model_config(NEXT_80B)


def fake_memory(monkeypatch, budget: int, cap: int = 141 * GiB) -> None:
    monkeypatch.setattr(sizing, "device_memory", lambda cfg, device: (budget, cap))
    monkeypatch.setattr(sizing, "device_cap", lambda cfg, device, total=None: cap)


def make(mc, tp: int = 1, **options) -> runtime.MoeRuntime:
    cfg = EngineConfig(config_file=NEXT_80B, load_format="dummy", **options)
    return runtime.MoeRuntime(cfg, mc, TPInfo(0, tp), CUDA, torch.bfloat16)


def test_auto_offloads_what_does_not_fit_and_says_so(mc, monkeypatch, capsys):
    fake_memory(monkeypatch, 125 * GiB)  # an H200 at --memory-ratio 0.9, nothing loaded yet
    assert make(mc).name == "offload"  # 148 GiB of bf16 weights on one rank
    assert "more than 90% of the 125.0 GiB GPU budget: experts offloaded" in capsys.readouterr().out
    assert make(mc, tp=2).name == "gpu"  # 74 GiB per rank fits
    assert make(mc, moe_backend="hybrid").name == "hybrid"


def test_slots_come_from_what_is_left(mc, monkeypatch):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with tp_context(TPInfo(0, 1)), torch.device("meta"):
            bank = BF16ExpertBank(mc.num_experts, mc.hidden_size, mc.moe_intermediate_size)
    finally:
        torch.set_default_dtype(previous)
    layout = ExpertLayout.of(bank)
    assert layout.expert_bytes == 3 * mc.hidden_size * mc.moe_intermediate_size * 2  # 6 MiB per expert
    layers, per_slot = 48, 48 * layout.expert_bytes
    rt = make(mc, moe_backend="offload")
    staging = 2 * 42 * layout.expert_bytes
    reserve = sizing.reserve_bytes(141 * GiB)
    fake_memory(monkeypatch, reserve + staging + 301 * per_slot + 5)
    assert rt._slots(layout, layers, 512, staging) == 300  # one row per layer is the null expert
    fake_memory(monkeypatch, reserve + staging + 2000 * per_slot)
    assert rt._slots(layout, layers, 512, staging) == 512
    fake_memory(monkeypatch, reserve + staging + per_slot)
    with pytest.raises(MemoryError, match=r"no room for an expert cache: .* one slot in each of 48 layers"):
        rt._slots(layout, layers, 512, staging)
    assert make(mc, moe_backend="offload", expert_cache_fraction=0.7)._slots(layout, layers, 512, 0) == 358


def test_lean_plan_for_the_full_80b_in_bf16_on_one_h200(mc, monkeypatch):
    """155 GB of bf16 experts, 128 GiB of host memory: the host keeps 426 experts of each layer (120
    GiB after 8 GiB headroom, 288 MiB an expert of every layer), so 86 are static; the slots come
    from the GPU budget less the planned pools and must hold the 86 and one token's 10 others."""
    rt = make(mc, moe_backend="offload")
    layout_bytes, layers = 3 * mc.hidden_size * mc.moe_intermediate_size * 2, 48
    per_expert = layers * layout_bytes
    assert host_experts(per_expert, 1, 128 * GiB) == 426
    rt.static = sizing.static_experts(rt.cfg, "offload", 512, host_experts(per_expert, 1, 128 * GiB))
    assert rt.static == 86
    assert sizing.static_experts(rt.cfg, "offload", 512, 512) == 0
    assert sizing.static_experts(rt.cfg, "hybrid", 512, 0) == 511  # check_host_memory refuses later
    assert sizing.static_experts(rt.cfg, "cpu", 512, 0) == 0  # the same, with the cpu backend's reason

    class Layout:
        expert_bytes = layout_bytes

    pools, staging = 3 * GiB, 2 * 42 * layout_bytes
    fixed = sizing.reserve_bytes(141 * GiB) + staging + pools
    fake_memory(monkeypatch, fixed + 380 * per_expert + 7)
    assert rt._slots(Layout, layers, 512, staging, pools) == 379  # each layer's null row too
    fake_memory(monkeypatch, fixed + 97 * per_expert)
    assert rt._slots(Layout, layers, 512, staging, pools) == 96  # 86 static + 10 dynamic
    fake_memory(monkeypatch, fixed + 90 * per_expert)
    with pytest.raises(MemoryError) as e:
        rt._slots(Layout, layers, 512, staging, pools)
    assert (
        "the host holds 426 of the 512 experts of each layer, so 86 must live on cuda:0 only, beside "
        "10 slots for the others: 97 rows in each of 48 layers take 27.28 GiB, but 25.31 GiB is left "
        "after weights, 3.00 GiB of KV and state pools, 7.0 GiB reserve and 0.49 GiB staging"
    ) in str(e.value)


def test_prefill_chunk_grows_when_experts_stream_as_far_as_the_reserve_allows(mc, monkeypatch):
    """Given, the chunk is the user's; resident experts or no GPU: 8192; offloading on a GPU: the
    largest power of two up to 32768 whose activations fit the reserve (less the graphs' margin)."""
    chunk = sizing.prefill_chunk
    per_token = sizing.activation_bytes_per_token(mc)
    assert 200_000 < per_token < 500_000  # ~320 KB a token of the 80B
    cfg = EngineConfig(config_file=NEXT_80B, load_format="dummy")
    given = EngineConfig(config_file=NEXT_80B, load_format="dummy", max_num_batched_tokens=4096)
    assert chunk(given, mc, CUDA, True) == 4096
    assert chunk(cfg, mc, CUDA, False) == chunk(cfg, mc, torch.device("cpu"), True) == 8192
    fake_memory(monkeypatch, 100 * GiB)  # a whole H200: a 7 GiB reserve, 6 GiB for activations
    assert chunk(cfg, mc, CUDA, True) == 16384
    fake_memory(monkeypatch, 30 * GiB, cap=48 * GiB)  # a 48 GiB card: 2.4 GiB, too little to grow
    assert chunk(cfg, mc, CUDA, True) == 8192
    assert sizing.grown_chunk(1 << 40, per_token) == 32768 and sizing.grown_chunk(0, per_token) == 8192
    assert sizing.grown_chunk(32768 * per_token, per_token) == 32768
    assert sizing.grown_chunk(32768 * per_token - 1, per_token) == 16384


def test_running_requests_default_leaves_the_expert_cache_its_room(mc, monkeypatch, capsys):
    """Not given, --max-running-requests is 64, or, when the experts stream on a hybrid model, the
    most (a power of two from 4) whose GDN state rows, a slot and a snapshot each, fit 1/32 of the
    device: the 80B's ~72 MiB rows give 8 under --max-gpu-memory 48GiB and 16 on a 141 GB H200."""
    import ft.engine.pools as pools
    from ft.engine.build import build_model

    model = build_model(mc, TPInfo(0, 1), "meta", torch.bfloat16)
    shapes = [m.state_shapes() for m in model.modules() if hasattr(m, "state_shapes")]
    row = sum(2 * conv[0] * conv[1] + 4 * ssm[0] * ssm[1] * ssm[2] for conv, ssm in shapes)
    assert len(shapes) == 36 and 70 * 2**20 < row < 75 * 2**20
    assert (
        sizing.default_running(48 * GiB, row, 1, 2) == 8
    )  # the scratch row, a slot and a snapshot a request
    assert sizing.default_running(141 * 10**9, row, 1, 2) == 16
    assert sizing.default_running(141 * 10**9, row, 1, 1) == 32  # no snapshot a request
    assert sizing.default_running(141 * 10**9, row, 33, 1) == 16  # 32 snapshots given
    assert sizing.default_running(None, row, 1, 2) == sizing.default_running(10**15, row, 1, 2) == 64
    assert sizing.default_running(48 * GiB, 0, 1, 2) == 64  # no GDN state
    assert sizing.default_running(GiB, row, 1, 2) == sizing.default_running(48 * GiB, row, 65, 1) == 4
    monkeypatch.setattr(pools, "device_cap", lambda cfg, device: 48 * GiB)
    cases = ({}, 8), ({"max_running_requests": 32}, 32), ({"prefix_snapshot_slots": 4}, 8)
    cases += (
        ({"prefix_snapshot_slots": 64}, 4),
        ({"prefix_snapshot_slots": 64, "enable_prefix_cache": False}, 16),
    )
    for options, want in cases:
        cfg = EngineConfig(config_file=NEXT_80B, load_format="dummy", **options)
        assert pools.max_running(cfg, CUDA, True, row, say=True) == want
    assert "at most 8 running requests" in capsys.readouterr().out
    cfg = EngineConfig(config_file=NEXT_80B, load_format="dummy")
    assert pools.max_running(cfg, CUDA, False, row, say=True) == 64  # resident experts: the usual 64
    assert pools.state_row_bytes(pools.CacheLayers.of(model), torch.bfloat16) == row
