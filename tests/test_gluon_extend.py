"""The Gluon extend attention's host side (``ft.attention.gluon_extend``) on CPU: what it takes and
the tiles it launches. Its kernel runs on a Hopper GPU only: tests/gpu/test_kernels.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from ft.attention import gluon_extend, gluon_extend_ws  # noqa: E402


def test_tiles_fit_a_hopper_sm():
    """Every head size's tile: 16 query rows a warp (the wgmma accumulators' layout), and Q plus the
    key/value slots within an H100/H200 SM's 227 KB of shared memory."""
    for d, (bm, bn, warps) in gluon_extend.TILES.items():
        assert bm == 16 * warps and bn % 16 == 0
        assert 2 * (bm * d + 2 * gluon_extend.SLOTS * bn * d) <= 227 * 1024, d
        layouts = gluon_extend.layouts(bm, bn, d, warps, torch.bfloat16)
        assert layouts["O_MMA"].instr_shape == [16, d, 16] and layouts["S_MMA"].instr_shape == [16, bn, 16]
    with pytest.raises(AssertionError):
        gluon_extend.layouts(128, 64, 256, 4, torch.bfloat16)  # 4 warps hold 64 rows, not 128


def test_cpu_tensors_take_the_triton_kernel():
    q = torch.zeros(8, 2, 256, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 2, 256, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    assert not gluon_extend.supports(q, cache, table)  # no GPU


def test_the_warp_specialised_kernel_splits_the_registers_and_the_rows():
    """``ws_layouts``: every partition 4 warps, a wgmma warpgroup 64 query rows; the producer's copies
    16 bytes or more a thread. ``ATTEND_REGS`` / ``LOAD_REGS`` by Triton's split (12 warps start at
    64K / 12 / 32 rounded to 8; the first warpgroup gets what the other two leave): both wgmma
    warpgroups the same count, within an SM's 64K."""
    for d, (bm, bn, _) in gluon_extend.TILES.items():
        lay = gluon_extend_ws.ws_layouts(bm, bn, d, torch.bfloat16)
        assert lay["S_MMA"].warps_per_cta == [4, 1] and lay["O_MMA"].instr_shape == [16, d, 16]
        assert lay["IO"].warps_per_cta == [4, 1] and lay["IO"].size_per_thread[1] >= 8
    start = 64 * 1024 // (12 * 32) // 8 * 8
    attend, load = gluon_extend_ws.ATTEND_REGS, gluon_extend_ws.LOAD_REGS
    assert (3 * start - attend - load) // 8 * 8 == attend
    assert (2 * attend + load) * 4 * 32 <= 64 * 1024
