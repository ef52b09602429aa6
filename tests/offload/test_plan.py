"""The MoE plan without a GPU: which backend ``auto`` picks and how many slots a budget buys, for
the real Qwen3-Next-80B-A3B config (on the meta device), with the GPU's memory figures faked."""

from __future__ import annotations

import os

import pytest
import torch

import ft.moe.backends.runtime as runtime
from ft.config import EngineConfig
from ft.distributed import TPInfo, tp_context
from ft.models.config import load_model_config
from ft.moe.backends.layout import ExpertLayout
from ft.moe.banks import BF16ExpertBank

NEXT_80B = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3_next_80b_a3b.json")
GiB = 1 << 30
CUDA = torch.device("cuda", 0)  # never touched: the memory figures are faked


@pytest.fixture(scope="module")
def mc():
    return load_model_config(NEXT_80B)


def fake_memory(monkeypatch, budget: int, cap: int = 141 * GiB) -> None:
    monkeypatch.setattr(runtime, "device_memory", lambda cfg, device: (budget, cap))


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
    reserve = runtime.reserve_bytes(141 * GiB)
    fake_memory(monkeypatch, reserve + staging + 301 * per_slot + 5)
    assert rt._slots(layout, layers, 512, staging) == 300  # one row per layer is the null expert
    fake_memory(monkeypatch, reserve + staging + 2000 * per_slot)
    assert rt._slots(layout, layers, 512, staging) == 512
    fake_memory(monkeypatch, reserve + staging + per_slot)
    with pytest.raises(MemoryError, match=r"no room for an expert cache: .* one slot in each of 48 layers"):
        rt._slots(layout, layers, 512, staging)
    assert make(mc, moe_backend="offload", expert_cache_fraction=0.7)._slots(layout, layers, 512, 0) == 358
