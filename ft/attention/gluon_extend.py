"""The paged extend (prefill) attention for Hopper in Gluon: wgmma from shared memory, no spills.

``triton_kernels.extend_kernel`` at Qwen3-Next's heads of 256 (128 x 64 tiles, 8 warps) compiles
to 255 registers and spills (tests/gpu/compile_check.py), masks every key tile causally, and ran
the second 16k chunk of a 32k prompt at ~390 TFLOP/s of causal work on an H200 (docs/benchmarks.md,
2026-12-04), most of that chunk's time: issue 8's 32k offloaded prefill is bound by it. Here the
same online softmax is written out over explicit shared memory:

    Q [BM, D] is copied once (cp.async) and stays in shared memory as wgmma's A operand;
    key/value tiles [BN, D] are gathered through the block table by cp.async, 16 bytes a copy,
    into two slots: tile j+1 lands while tile j is multiplied;
    S = Q K^T (wgmma, async, waited), softmax in registers (fp32, base 2), P = S's probabilities
    rounded to the value dtype and fed to O += P V from registers (wgmma's register A operand);
    the key tiles before the block's first query (every one of its queries sees them) run
    without the causal select, the last one or two with it;
    the query blocks run heaviest first (the last block of a causal prompt sees the most keys).

Per tile the arithmetic is ``_attend_tile``'s: s · qk_scale (log2 e folded in), m = max(m, rowmax),
p = exp2(s - m), l = l · alpha + rowsum(p), acc = acc · alpha + p V, out = acc / l. The products'
order within a tile is wgmma's, so the bits may differ from the Triton kernel's; the values agree
to fp32 accumulation (tests/gpu/test_kernels.py compares both with the torch backend).

Takes what ``supports`` says fits (a Hopper GPU, 16-bit heads of 64, 128 or 256, 16-byte aligned
rows); ``triton_paged.GLUON_EXTEND`` (on; FT_ATTN_GLUON_EXTEND=0 turns it off for a process).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ft.layers.gluon_sync import cta_barrier

# (BLOCK_M, BLOCK_N, warps) by head size: a warp holds 16 query rows of the wgmma accumulators
# ([16, D] fp32: 128 registers a thread at D = 256). Shared memory: Q [BM, D] plus two slots of
# K and V [BN, D]: 64 + 128 KB at D = 256.
TILES = {64: (128, 64, 8), 128: (128, 64, 8), 256: (128, 64, 8)}
SLOTS = gl.constexpr(2)  # key/value tile slots: tile j + 1 is copied while tile j is multiplied


@gluon.jit
def _copy_kv(k_cache, v_cache, table, hk, t, n_tiles, kv_end, k_s, v_s, s_cb, s_cs, s_ch,
             D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, IO: gl.constexpr):  # fmt: skip
    # key tile t's rows (past the last tile: nothing copied, an empty group) into one slot, a group
    n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, IO))
    live = (n < kv_end) & (t < n_tiles)
    blk = gl.load(table + n // PAGE, mask=live, other=0).to(gl.int64)
    off = blk * s_cb + (n % PAGE) * s_cs + hk * s_ch
    ptr = off[:, None] + gl.arange(0, D, layout=gl.SliceLayout(0, IO))[None, :]
    mask = live[:, None]
    async_copy.async_copy_global_to_shared(k_s, k_cache + ptr, mask=mask)  # rows past kv_end: zeros
    async_copy.async_copy_global_to_shared(v_s, v_cache + ptr, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _tile(q_s, k_s, v_s, m_i, l_i, acc, qk_scale, qpos, n0, kv_end, MASKED: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr,
          P_OP: gl.constexpr):  # fmt: skip
    # one online-softmax step over the key tile in (k_s, v_s); returns with its wgmmas retired
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_MMA)
    s = warpgroup_mma(q_s, k_s.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s = s * qk_scale
    if MASKED:  # causal, and the last tile's rows past the sequence's keys
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))
        visible = (n[None, :] < kv_end) & (n[None, :] <= qpos[:, None])
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))
    acc = acc * alpha_o[:, None]
    p_op = gl.convert_layout(p.to(v_s.dtype), P_OP)
    acc = warpgroup_mma(p_op, v_s, acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))  # P's registers kept until then
    return m_new, l_i, acc


@gluon.jit
def _step(q_s, k_s, v_s, m_i, l_i, acc, j, k_cache, v_cache, table, hk, n_tiles, kv_end, qk_scale, qpos,
          s_cb, s_cs, s_ch, MASKED: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, S_MMA: gl.constexpr, O_MMA: gl.constexpr, P_OP: gl.constexpr,
          IO: gl.constexpr):  # fmt: skip
    # key tile j: wait for its copies, attend, then copy tile j + SLOTS into the slot it leaves
    slot = j % SLOTS
    async_copy.wait_group(SLOTS - 1)  # tile j's copies (this thread's) have landed,
    fence_async_shared()  # visible to the wgmmas (cp.async writes through the generic proxy)
    cta_barrier()  # ... and every thread's
    ks = k_s.index(slot)
    vs = v_s.index(slot)
    m_i, l_i, acc = _tile(q_s, ks, vs, m_i, l_i, acc, qk_scale, qpos, j * BLOCK_N, kv_end, MASKED, BLOCK_M,
                          BLOCK_N, S_MMA, O_MMA, P_OP)  # fmt: skip
    cta_barrier()  # every warpgroup has read the slot: tile j + SLOTS goes there
    _copy_kv(k_cache, v_cache, table, hk, j + SLOTS, n_tiles, kv_end, ks, vs, s_cb, s_cs, s_ch, D, PAGE,
             BLOCK_N, IO)  # fmt: skip
    return m_i, l_i, acc


@gluon.jit
def _copy_q(q, q_s, q_start, q_len, h, s_qt, s_qh, row0, ROWS: gl.constexpr, D: gl.constexpr,
            IO: gl.constexpr):  # fmt: skip
    # the sequence's query rows row0 .. row0 + ROWS of head h into q_s (rows past q_len: zeros); the
    # copies join the caller's next group
    m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, IO))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, IO))
    ptr = q + (q_start + m)[:, None] * s_qt + h * s_qh + d[None, :]
    async_copy.async_copy_global_to_shared(q_s, ptr, mask=(m < q_len)[:, None])


@gluon.jit
def _store_rows(acc, l_i, out, q_start, q_len, h, s_ot, s_oh, row0, ROWS: gl.constexpr, D: gl.constexpr,
                O_MMA: gl.constexpr):  # fmt: skip
    # out rows row0 .. row0 + ROWS of head h = acc / l (every query sees key 0, so l > 0); rows past
    # q_len are not written
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_MMA))
    o = acc / l_o[:, None]
    m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_MMA))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, O_MMA))
    dst = out + (q_start + m)[:, None] * s_ot + h * s_oh + d[None, :]
    gl.store(dst, o.to(out.dtype.element_ty), mask=(m < q_len)[:, None])


@gluon.jit
def _program(cu_seqlens):
    # (query block, sequence, head) of this program, the last query block first, and its sequence's
    # first row and length (int32: tile and slot indices)
    mb = gl.num_programs(0) - 1 - gl.program_id(0)
    b = gl.program_id(1)
    h = gl.program_id(2)
    first = gl.load(cu_seqlens + b)
    q_len = gl.load(cu_seqlens + b + 1) - first
    return mb, b, h, first.to(gl.int64), q_len


@gluon.jit
def _keys(context_lens, block_tables, s_bt, mb, b, h, q_len, REP: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr):  # fmt: skip
    # the block's keys: cached context, kv head, block table row, the end of its causal keys, its key
    # tiles and how many of them every query of the block sees whole
    ctx = gl.load(context_lens + b)
    kv_end = gl.minimum(ctx + q_len, ctx + (mb + 1) * BLOCK_M)
    n_tiles = gl.cdiv(kv_end, BLOCK_N)
    n_full = gl.minimum((ctx + mb * BLOCK_M + 1) // BLOCK_N, n_tiles)
    return ctx, h // REP, block_tables + b * s_bt, kv_end, n_tiles, n_full


@gluon.jit
def _extend_wgmma_kernel(
    q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, out, qk_scale,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
    REP: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    S_MMA: gl.constexpr, O_MMA: gl.constexpr, P_OP: gl.constexpr, IO: gl.constexpr,
    Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr,
):  # fmt: skip
    # one program = BLOCK_M queries of one sequence x one query head, the last query block first
    mb, b, h, q_start, q_len = _program(cu_seqlens)
    if mb * BLOCK_M >= q_len:
        return
    ctx, hk, table, kv_end, n_tiles, n_full = _keys(context_lens, block_tables, s_bt, mb, b, h, q_len, REP,
                                                    BLOCK_M, BLOCK_N)  # fmt: skip

    q_s = gl.allocate_shared_memory(q.dtype.element_ty, [BLOCK_M, D], Q_SMEM)
    k_s = gl.allocate_shared_memory(k_cache.dtype.element_ty, [SLOTS, BLOCK_N, D], KV_SMEM)
    v_s = gl.allocate_shared_memory(v_cache.dtype.element_ty, [SLOTS, BLOCK_N, D], KV_SMEM)
    _copy_q(q, q_s, q_start, q_len, h, s_qt, s_qh, mb * BLOCK_M, BLOCK_M, D, IO)  # with tile 0's group
    for t in gl.static_range(SLOTS):
        _copy_kv(k_cache, v_cache, table, hk, t, n_tiles, kv_end, k_s.index(t), v_s.index(t), s_cb, s_cs,
                 s_ch, D, PAGE, BLOCK_N, IO)  # fmt: skip

    qpos = ctx + mb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_MMA))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_MMA))
    acc = gl.zeros([BLOCK_M, D], gl.float32, O_MMA)
    # the key tiles every query of the block sees whole, then the diagonal ones (two loops: a wgmma
    # under a branch inside the loop miscompiled with Triton 3.6, wrong scores and out-of-range
    # shared addresses on an H200, 2026-12-04)
    for j in range(0, n_full):
        m_i, l_i, acc = _step(q_s, k_s, v_s, m_i, l_i, acc, j, k_cache, v_cache, table, hk, n_tiles, kv_end,
                              qk_scale, qpos, s_cb, s_cs, s_ch, False, D, PAGE, BLOCK_M, BLOCK_N, S_MMA,
                              O_MMA, P_OP, IO)  # fmt: skip
    for j in range(n_full, n_tiles):
        m_i, l_i, acc = _step(q_s, k_s, v_s, m_i, l_i, acc, j, k_cache, v_cache, table, hk, n_tiles, kv_end,
                              qk_scale, qpos, s_cb, s_cs, s_ch, True, D, PAGE, BLOCK_M, BLOCK_N, S_MMA,
                              O_MMA, P_OP, IO)  # fmt: skip
    async_copy.wait_group(0)

    _store_rows(acc, l_i, out, q_start, q_len, h, s_ot, s_oh, mb * BLOCK_M, BLOCK_M, D, O_MMA)


def supports(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> bool:
    """Whether ``launch`` takes these: a Hopper GPU (wgmma), 16-bit q and cache of one dtype, heads
    of 64, 128 or 256, and every row copy 16-byte aligned (the tensors' starts, q's and the cache's
    strides multiples of 8 elements)."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and q.dtype in (torch.bfloat16, torch.float16)
        and kv_cache.dtype == q.dtype
        and d in TILES
        and q.stride(-1) == 1
        and kv_cache.stride(-1) == 1
        and q.data_ptr() % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
        and all(s % 8 == 0 for s in (*q.stride()[:-1], *kv_cache.stride()[:-1]))
        and block_tables.dtype == torch.int32
    )


def layouts(block_m: int, block_n: int, d: int, warps: int, dtype: torch.dtype) -> dict:
    """The kernel's layouts: the two wgmma accumulators (S [BM, BN], O [BM, D]; a warp 16 rows), P as
    O's register A operand, the copies' (16 bytes a thread, a row across up to 32 threads) and the
    shared tiles' swizzles."""
    assert block_m == 16 * warps and warps in (4, 8), f"BLOCK_M {block_m} is not 16 x warps ({warps})"
    elem = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    cols = min(32, d // 8)
    o_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, d, 16])
    s_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16])
    return dict(
        S_MMA=s_mma,
        O_MMA=o_mma,
        P_OP=gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2),
        IO=gl.BlockedLayout([1, 8], [32 // cols, cols], [warps, 1], [1, 0]),
        Q_SMEM=gl.NVMMASharedLayout.get_default_for([block_m, d], elem),
        KV_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, d], elem),
    )


def launch(q, kv_cache, block_tables, cu_seqlens, context_lens, max_query_len: int, qk_scale: float,
           cache_strides):  # fmt: skip
    """``triton_paged.paged_extend``'s contract on q [T, Hq, d] (rows contiguous) with ``qk_scale``
    carrying log2(e); returns out [T, Hq, d]."""
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    block_m, block_n, warps = TILES[d]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(max_query_len, block_m), cu_seqlens.shape[0] - 1, hq)
    from ft.attention import gluon_extend_ws  # its helpers are this module's

    if gluon_extend_ws.WS:  # three warpgroups of 4 warps, 64 query rows each for the two that multiply
        kernel, warps = gluon_extend_ws._extend_ws_kernel, 4
        lay = gluon_extend_ws.ws_layouts(block_m, block_n, d, q.dtype)
        lay.update(ATTEND_REGS=gluon_extend_ws.ATTEND_REGS, LOAD_REGS=gluon_extend_ws.LOAD_REGS)
    else:
        kernel, lay = _extend_wgmma_kernel, layouts(block_m, block_n, d, warps, q.dtype)
    kernel[grid](
        q, kv_cache[0], kv_cache[1], block_tables, cu_seqlens, context_lens, out, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, block_tables.stride(0),
        REP=hq // hkv, D=d, PAGE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        **lay, num_warps=warps,
    )  # fmt: skip
    return out
