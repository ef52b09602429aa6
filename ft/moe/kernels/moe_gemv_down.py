"""The MoE GEMV's down kernel and its tile, as ``triton_moe_gemv`` launches them: one program per
(token, BLOCK_N rows of H, pair), the pair's weighted term into a workspace; the row block's last
program (by ticket) sums them in pair order. The pieces both kernels read rows with:
``moe_gemv_kernels``. The maths and the switches: ``triton_moe_gemv``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.layers.pdl import wait_for_previous
from ft.moe.kernels.fp4_words import INPUT_BY, code, fp4_words, input_pair
from ft.moe.kernels.moe_gemv_kernels import _expert, _inputs, _plain_rows, _rows


@triton.jit
def _down_pair_kernel(
    act, b, b_scale, b_global, host_b, host_scale, host_global, shared_b, shared_logit, out, topk_w,
    topk_ids, ws, counters, N, K,
    s_at, s_be, s_bn, s_se, s_sn, s_ge, s_hn, s_ot, s_wt, s_wk, s_it, s_ik, s_lt, unfold,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr = 1, HOST: tl.constexpr = False,
    PLANES: tl.constexpr = False, USE_PDL: tl.constexpr = False, SHARED_BLOCK_K: tl.constexpr = 0,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    down_tile(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), act, b, b_scale, b_global,
        host_b, host_scale, host_global, shared_b, shared_logit, out, topk_w, topk_ids, ws, counters, N, K,
        s_at, s_be, s_bn, s_se, s_sn, s_ge, s_hn, s_ot, s_wt, s_wk, s_it, s_ik, s_lt, unfold, TOPK, SHARED,
        FP4, EVEN_K, BLOCK_N, BLOCK_K, LOOP_STAGES, HOST, PLANES, SHARED_BLOCK_K,
    )  # fmt: skip


@triton.jit
def down_tile(
    tok, block, slot, row_blocks, act, b, b_scale, b_global, host_b, host_scale, host_global, shared_b,
    shared_logit, out, topk_w, topk_ids, ws, counters, N, K,
    s_at, s_be, s_bn, s_se, s_sn, s_ge, s_hn, s_ot, s_wt, s_wk, s_it, s_ik, s_lt, unfold,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr, HOST: tl.constexpr,
    PLANES: tl.constexpr, SHARED_BLOCK_K: tl.constexpr,
):  # fmt: skip
    # the term of pair (tok, slot) for BLOCK_N rows n of H (row block ``block`` of ``row_blocks``), weighted
    # and rounded to out's dtype, into ws[tok, slot, n]; the (tok, rows) block's last program writes
    # out[tok, n], the sum in pair order
    tok = tok.to(tl.int64)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    a_row = act + (tok * (TOPK + SHARED) + slot) * s_at
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if not FP4:  # one loop, as in ``_gate_up_kernel``: the shared rows differ only in start and stride
        e = tl.load(topk_ids + tok * s_it + slot * s_ik, mask=slot < TOPK, other=0).to(tl.int64)
        rows = _expert(e, b, b, b, host_b, host_b, host_b, s_be, s_be, s_be, HOST)[0]
        stride = s_bn
        if SHARED:
            rows, stride = tl.where(slot == TOPK, shared_b, rows), tl.where(slot == TOPK, s_hn, s_bn)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
            acc += _plain_rows(rows, n, k0, stride, nmask, K, EVEN_K, BLOCK_N, BLOCK_K) * _inputs(
                a_row, k0, K, EVEN_K, BLOCK_K
            )
        scale = tl.load(topk_w + tok * s_wt + slot * s_wk, mask=slot < TOPK, other=0.0).to(tl.float32)
        if SHARED:
            logit = tl.load(shared_logit + tok * s_lt).to(tl.float32)
            scale = tl.where(slot == TOPK, tl.sigmoid(logit), scale)
        term = tl.sum(acc, axis=1) * scale
    else:
        is_shared = False
        if SHARED:
            is_shared = slot == TOPK
        if is_shared:  # its own step (``SHARED_BLOCK_K``, 0: BLOCK_K)
            SBK: tl.constexpr = SHARED_BLOCK_K or BLOCK_K
            sacc = tl.zeros([BLOCK_N, SBK], tl.float32)
            for k0 in tl.range(0, K, SBK, num_stages=LOOP_STAGES):
                w = _plain_rows(shared_b, n, k0, s_hn, nmask, K, EVEN_K, BLOCK_N, SBK)
                sacc += w * _inputs(a_row, k0, K, EVEN_K, SBK)
            term = tl.sum(sacc, axis=1) * tl.sigmoid(tl.load(shared_logit + tok * s_lt).to(tl.float32))
        else:
            e = tl.load(topk_ids + tok * s_it + slot * s_ik).to(tl.int64)
            b_e, s_e, g_e = _expert(
                e, b, b_scale, b_global, host_b, host_scale, host_global, s_be, s_se, s_ge, HOST
            )
            if PLANES:  # codes as words, a block's scale once (``FP4_DOWN_PLANES``)
                blocks = tl.zeros([BLOCK_N, BLOCK_K // 16, 1], tl.float32)
                for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
                    wd, sd = fp4_words(b_e, s_e, n, k0, s_bn, s_sn, nmask, K, EVEN_K, BLOCK_N, BLOCK_K)
                    bd = tl.zeros([BLOCK_N, BLOCK_K // 16, 2], tl.float32)
                    for q in tl.static_range(4):
                        lo, hi = input_pair(a_row, k0, q, K, EVEN_K, BLOCK_K, INPUT_BY)
                        bd += code(wd, 2 * q) * lo
                        bd += code(wd, 2 * q + 1) * hi
                    blocks += tl.sum(bd, axis=2, keep_dims=True) * sd
                dot = tl.sum(tl.sum(blocks, axis=2), axis=1)
            else:
                for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
                    w = _rows(b_e, s_e, n, k0, s_bn, s_sn, nmask, K, FP4, EVEN_K, BLOCK_N, BLOCK_K)
                    acc += w * _inputs(a_row, k0, K, EVEN_K, BLOCK_K)
                dot = tl.sum(acc, axis=1)
            scale = tl.load(topk_w + tok * s_wt + slot * s_wk).to(tl.float32)
            term = dot * (tl.load(g_e + n, mask=nmask, other=0.0) * (scale * unfold))
    cell = ws + tok * (TOPK + SHARED) * N + n  # ws[tok, 0, n]
    tl.store(cell + slot * N, term.to(out.dtype.element_ty).to(tl.float32), mask=nmask)
    # the ticket is one thread's atomic: the barrier puts every thread's stores before its release
    tl.debug_barrier()
    counter = counters + tok * row_blocks + block
    ticket = tl.atomic_add(counter, 1, sem="acq_rel")
    if ticket == TOPK + SHARED - 1:  # the others' terms past the acquire, from L2 (.cg)
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOPK + SHARED):
            total += tl.load(cell + j * N, mask=nmask, other=0.0, cache_modifier=".cg")
        tl.store(out + tok * s_ot + n, total.to(out.dtype.element_ty), mask=nmask)
        tl.store(counter, 0)  # every ticket is drawn: clean for the next call
