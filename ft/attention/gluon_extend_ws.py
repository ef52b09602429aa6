"""The paged extend attention for Hopper in Gluon, warp-specialised: ``gluon_extend``'s kernel with
each wgmma warpgroup a partition of its own and the copies in a third.

``gluon_extend._extend_wgmma_kernel`` (on since 2026-12-04: 444 TFLOP/s at a 32k prompt's second
16k chunk on an H200) runs its two wgmma warpgroups in one partition: both copy the next key tile
and meet at two CTA-wide barriers a tile, so they run in step and the tensor cores idle while
both compute their softmax (ptxas would not overlap a warpgroup's softmax with its own wgmmas
either: docs/benchmarks.md). Here (``gl.warp_specialize``):

    producer (4 warps, setmaxnreg LOAD_REGS): Q's halves and key tiles 0 and 1 copied (cp.async)
        and signalled full as they land; tile j (j >= 2) copied into tile j-2's slot once both
        warpgroups have handed it back (empty, one arrival from each), then signalled full
    two wgmma partitions (4 warps each, 64 query rows, setmaxnreg ATTEND_REGS): each key tile
        once full, ``gluon_extend._tile``'s online softmax step, hand the slot back; then its rows
        of the output

The warpgroups drift up to a tile apart, so one's softmax can run beside the other's wgmmas. The
arithmetic is ``_tile``'s (the unmasked and masked tiles in two loops, as there), so the output
should be ``_extend_wgmma_kernel``'s bit for bit.

Run on an H200 on 2026-12-04 18:08 (docs/benchmarks.md): its GPU tests pass
(tests/gpu/test_kernels.py -k extend), an 8k prompt's attention is 5% faster than the
one-partition kernel's (1,283.8 against 1,351.4 us, heads of 256) and a 32k prompt's second 16k
chunk level (14,614 against 14,599 us); the 80B's 32k prefill the same share of the link with it
(84.6-85.4% against 84.7-85.3%, a load each). Off (``WS``): nothing in the engine to show for it.
Compiled for sm_90 with Triton 3.6: 224 registers a wgmma thread, the producer 56 with 2 spilled
values at heads of 256, 197 KB shared.
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

from ft.attention.gluon_extend import SLOTS, _copy_kv, _copy_q, _keys, _program, _store_rows, _tile, layouts

# in place of ``gluon_extend._extend_wgmma_kernel`` when on (FT_ATTN_GLUON_EXTEND_WS=1)
WS = os.environ.get("FT_ATTN_GLUON_EXTEND_WS", "0") == "1"
# its partitions' registers (setmaxnreg): Triton starts 12 warps at 168 and gives the first
# warpgroup what the other two leave, 504 - ATTEND_REGS - LOAD_REGS = ATTEND_REGS here
ATTEND_REGS, LOAD_REGS = 224, 56


def ws_layouts(block_m: int, block_n: int, d: int, dtype: torch.dtype) -> dict:
    """``layouts`` for ``_extend_ws_kernel``: every partition 4 warps, a wgmma warpgroup 64 query rows
    (half of ``block_m``); the producer's copies 16 elements a thread (two 16-byte copies) at heads of
    256, so that a thread holds half the row pointers (at 8 a thread its 56 registers spilled)."""
    lay = layouts(block_m // 2, block_n, d, 4, dtype)
    per = 16 if d >= 256 else 8
    lay["IO"] = gl.BlockedLayout([1, per], [32 // (d // per), d // per], [4, 1], [1, 0])
    return lay


@gluon.jit
def _ws_step(q_s, k_s, v_s, full, empty, m_i, l_i, acc, j, qk_scale, qpos, kv_end, MASKED: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr,
             P_OP: gl.constexpr):  # fmt: skip
    # key tile j once the producer has signalled it full, handed back on empty once attended
    slot = j % SLOTS
    mbarrier.wait(full.index(slot), (j // SLOTS) & 1)
    m_i, l_i, acc = _tile(q_s, k_s.index(slot), v_s.index(slot), m_i, l_i, acc, qk_scale, qpos, j * BLOCK_N,
                          kv_end, MASKED, BLOCK_M, BLOCK_N, S_MMA, O_MMA, P_OP)  # fmt: skip
    mbarrier.arrive(empty.index(slot))
    return m_i, l_i, acc


@gluon.jit
def _ws_attend(q_s, k_s, v_s, full, empty, out, qk_scale, q_start, q_len, ctx, mb, h, kv_end, n_tiles, n_full,
               s_ot, s_oh, ROWS: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               S_MMA: gl.constexpr, O_MMA: gl.constexpr, P_OP: gl.constexpr):  # fmt: skip
    # a wgmma warpgroup's partition: its 64 query rows (ROWS: 0 or 1) over every key tile, each tile
    # once the producer has signalled it full, handed back on empty once this warpgroup is past it;
    # then its rows of the output. The other warpgroup runs the same on its own schedule (up to a
    # tile apart), so one's softmax can run beside the other's wgmmas
    HALF: gl.constexpr = BLOCK_M // 2
    qs = q_s.index(ROWS)
    row0 = mb * BLOCK_M + ROWS * HALF
    qpos = ctx + row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, S_MMA))
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, S_MMA))
    acc = gl.zeros([HALF, D], gl.float32, O_MMA)
    for j in range(0, n_full):
        m_i, l_i, acc = _ws_step(qs, k_s, v_s, full, empty, m_i, l_i, acc, j, qk_scale, qpos, kv_end, False,
                                 HALF, BLOCK_N, S_MMA, O_MMA, P_OP)  # fmt: skip
    for j in range(n_full, n_tiles):
        m_i, l_i, acc = _ws_step(qs, k_s, v_s, full, empty, m_i, l_i, acc, j, qk_scale, qpos, kv_end, True,
                                 HALF, BLOCK_N, S_MMA, O_MMA, P_OP)  # fmt: skip
    _store_rows(acc, l_i, out, q_start, q_len, h, s_ot, s_oh, row0, HALF, D, O_MMA)


@gluon.jit
def _ws_load(q, k_cache, v_cache, table, q_s, k_s, v_s, full, empty, q_start, q_len, hk, h, mb, kv_end,
             n_tiles,
             s_qt, s_qh, s_cb, s_cs, s_ch, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, IO: gl.constexpr):  # fmt: skip
    # the producer partition: Q's two row halves and key tile 0 as one group, tile 1 as the next, each
    # tile signalled full once landed (fenced for the wgmmas); tile j (j >= 2) copied into tile j-2's
    # slot once both warpgroups have handed that one back
    HALF: gl.constexpr = BLOCK_M // 2
    for r in gl.static_range(2):
        _copy_q(q, q_s.index(r), q_start, q_len, h, s_qt, s_qh, mb * BLOCK_M + r * HALF, HALF, D, IO)
    for t in gl.static_range(SLOTS):
        _copy_kv(k_cache, v_cache, table, hk, t, n_tiles, kv_end, k_s.index(t), v_s.index(t), s_cb, s_cs,
                 s_ch, D, PAGE, BLOCK_N, IO)  # fmt: skip
    async_copy.wait_group(1)  # Q and tile 0
    fence_async_shared()
    mbarrier.arrive(full.index(0))
    async_copy.wait_group(0)  # tile 1 (all zeros past the last tile: signalled, never waited for)
    fence_async_shared()
    mbarrier.arrive(full.index(1))
    for j in range(SLOTS, n_tiles):
        slot = j % SLOTS
        mbarrier.wait(empty.index(slot), ((j - SLOTS) // SLOTS) & 1)  # tile j-2 handed back by both
        _copy_kv(k_cache, v_cache, table, hk, j, n_tiles, kv_end, k_s.index(slot), v_s.index(slot), s_cb,
                 s_cs, s_ch, D, PAGE, BLOCK_N, IO)  # fmt: skip
        async_copy.wait_group(0)
        fence_async_shared()
        mbarrier.arrive(full.index(slot))


@gluon.jit
def _extend_ws_kernel(
    q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, out, qk_scale,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
    REP: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    S_MMA: gl.constexpr, O_MMA: gl.constexpr, P_OP: gl.constexpr, IO: gl.constexpr,
    Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, ATTEND_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
):  # fmt: skip
    # ``_extend_wgmma_kernel``'s contract and arithmetic, warp-specialised: launched with 4 warps (the
    # first wgmma warpgroup, rows 0-63 of the block), plus a second warpgroup (rows 64-127) and a
    # 4-warp producer for the copies; key tiles handed over through mbarriers instead of the CTA's
    # barriers, so the two warpgroups are not held in step
    mb, b, h, q_start, q_len = _program(cu_seqlens)
    if mb * BLOCK_M >= q_len:
        return
    ctx, hk, table, kv_end, n_tiles, n_full = _keys(context_lens, block_tables, s_bt, mb, b, h, q_len, REP,
                                                    BLOCK_M, BLOCK_N)  # fmt: skip
    q_s = gl.allocate_shared_memory(q.dtype.element_ty, [2, BLOCK_M // 2, D], Q_SMEM)
    k_s = gl.allocate_shared_memory(k_cache.dtype.element_ty, [SLOTS, BLOCK_N, D], KV_SMEM)
    v_s = gl.allocate_shared_memory(v_cache.dtype.element_ty, [SLOTS, BLOCK_N, D], KV_SMEM)
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(SLOTS):
        mbarrier.init(full.index(t), count=1)  # the producer's arrival
        mbarrier.init(empty.index(t), count=2)  # one from each wgmma warpgroup
    gl.warp_specialize(
        (
            (_ws_attend, (q_s, k_s, v_s, full, empty, out, qk_scale, q_start, q_len, ctx, mb, h, kv_end,
                          n_tiles, n_full, s_ot, s_oh, 0, D, BLOCK_M, BLOCK_N, S_MMA, O_MMA, P_OP)),
            (_ws_attend, (q_s, k_s, v_s, full, empty, out, qk_scale, q_start, q_len, ctx, mb, h, kv_end,
                          n_tiles, n_full, s_ot, s_oh, 1, D, BLOCK_M, BLOCK_N, S_MMA, O_MMA, P_OP)),
            (_ws_load, (q, k_cache, v_cache, table, q_s, k_s, v_s, full, empty, q_start, q_len, hk, h, mb,
                        kv_end, n_tiles, s_qt, s_qh, s_cb, s_cs, s_ch, D, PAGE, BLOCK_M, BLOCK_N, IO)),
        ),
        (4, 4),
        (ATTEND_REGS, LOAD_REGS),
    )  # fmt: skip
