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
