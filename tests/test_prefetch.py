"""``ft.layers.pdl.prefetch_bytes``: the bytes of each weight row a launch's programs prefetch into L2
before their PDL wait (``PREFETCH_MB``), on the host: off, within the budget, and refused for what
a bulk prefetch cannot take (an unaligned start, a size not a multiple of 16 bytes, K % 8)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from ft.layers import pdl, triton_gemv  # noqa: E402


@pytest.fixture
def on_pdl(monkeypatch):
    # a CPU tensor stands in for a device one: only the launch keywords' presence is asked
    monkeypatch.setattr(pdl, "pdl_args", lambda t: {"USE_PDL": 2, "launch_pdl": True})
    monkeypatch.setattr(pdl, "PREFETCH_MB", 1)
    return monkeypatch


def test_off_without_the_budget_or_pdl(monkeypatch):
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(pdl, "PREFETCH_MB", 24)
    assert pdl.prefetch_bytes(w, 64, 512) == 0  # a CPU tensor: no PDL
    monkeypatch.setattr(pdl, "pdl_args", lambda t: {"USE_PDL": 2, "launch_pdl": True})
    assert pdl.prefetch_bytes(w, 64, 512) == 512
    monkeypatch.setattr(pdl, "PREFETCH_MB", 0)
    assert pdl.prefetch_bytes(w, 64, 512) == 0


def test_the_budget_shares_rows_in_16_byte_steps(on_pdl):
    w = torch.zeros(12352, 2048, dtype=torch.bfloat16)  # in_proj: 50.6 MB against 1 MiB
    got = pdl.prefetch_bytes(w, 12352, 4096)
    assert got == (1 << 20) // 12352 // 16 * 16 == 80
    assert pdl.prefetch_bytes(w[:64], 64, 4096) == 4096  # within the budget: whole rows


def test_unaligned_rows_and_sizes_are_refused(on_pdl):
    w = torch.zeros(64, 264, dtype=torch.bfloat16)
    assert pdl.prefetch_bytes(w, 64, 528) == 528
    assert pdl.prefetch_bytes(w[:, 1:], 64, 526) == 0  # the start 2 bytes past alignment
    assert pdl.prefetch_bytes(w, 64, 520) == 0  # not a multiple of 16
    odd = torch.zeros(64, 260, dtype=torch.bfloat16)  # rows 520 bytes apart
    assert pdl.prefetch_bytes(odd, 64, 512) == 0
    assert pdl.prefetch_bytes(w.t(), 64, 512) == 0  # no unit inner stride


def test_split_programs_prefetch_their_split(on_pdl):
    on_pdl.setattr(pdl, "PREFETCH_MB", 24)
    w = torch.zeros(513, 2048, dtype=torch.bfloat16)
    p = triton_gemv.plan(513, 2048, 4)
    assert p.splits == 4 and triton_gemv.split_prefetch_bytes(w, p) == p.k_split * 2
    tail = torch.zeros(70, 300, dtype=torch.bfloat16)  # K % 8: a split's bytes may not be 16-byte steps
    assert triton_gemv.split_prefetch_bytes(tail, triton_gemv.plan(70, 300, 1)) == 0
