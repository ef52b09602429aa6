"""``ft.engine.allocator``: expandable segments asked for by the switch reach the CUDA allocator,
once, and never over a user's own allocator settings or on a CPU engine."""

from __future__ import annotations

import torch

from ft.engine import allocator


def _recording(monkeypatch, expandable: bool) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(allocator, "EXPANDABLE", expandable)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in allocator.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_switch_turns_expandable_segments_on_for_a_cuda_engine(monkeypatch):
    calls = _recording(monkeypatch, True)
    assert allocator.configure(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]


def test_off_by_default_on_a_cpu_and_under_the_users_settings(monkeypatch):
    calls = _recording(monkeypatch, False)
    assert not allocator.configure(torch.device("cuda", 0))  # the switch off
    monkeypatch.setattr(allocator, "EXPANDABLE", True)
    assert not allocator.configure(torch.device("cpu"))
    for name in allocator.USER_SETTINGS:
        monkeypatch.setenv(name, "max_split_size_mb:512")
        assert not allocator.configure(torch.device("cuda", 0)), name
        monkeypatch.delenv(name)
    assert calls == []


def test_the_cap_leaves_the_context_its_share_of_the_smaller_card(monkeypatch):
    """Under --max-gpu-memory 48 GiB on a 140 GiB card whose CUDA context holds 0.5 GiB outside
    torch's allocator, the allocator may reserve 47.5 GiB; no cap, or one above the card, is no
    limit."""
    g = 2**30
    total, reserved = 140 * g, 2 * g
    free = total - reserved - g // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    context = allocator.outside(torch.device("cuda", 0))
    assert context == (g // 2, total)
    assert allocator.cap_fraction(48 * g, *context) == 47.5 / 140
    assert allocator.cap_fraction(None, *context) == 1.0
    assert allocator.cap_fraction(200 * g, *context) == 1.0


def test_the_cap_reaches_torch_on_a_cuda_device_only(monkeypatch):
    g = 2**30
    set_to = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * g, 140 * g))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * g - g // 2)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: set_to.append(f))
    assert allocator.cap(48 * g, torch.device("cpu")) is None and set_to == []
    assert allocator.cap(48 * g, torch.device("cuda", 0)) == 47.5 / 140
    assert allocator.cap(None, torch.device("cuda", 0)) == 1.0  # an earlier engine's limit lifted
    assert set_to == [47.5 / 140, 1.0]
