"""The MoE GEMV's gate/up kernel and the pieces both its kernels share, as ``triton_moe_gemv``
launches them.

``_gate_up_kernel``: one program per (pair, BLOCK_N rows of I), act = silu(gate) · up of its rows
(``gate_up_tile``); the down kernel and its tile are ``moe_gemv_down``'s. An expert's rows
are a slot's or, with ``HOST``, the host store's for a negative id (``_expert``); NVFP4 rows are
decoded byte-wise (``_rows``), as 32-bit words of eight codes (``fp4_words``) or as integer dot
products (``int_dot``); a shared expert's bf16 rows run beside either format. The maths, the
switches that pick among these and why each is on or off: ``triton_moe_gemv``. Not here: operand
checks, tiles, launches, the operands as the kernels take them (``moe_gemv_operands``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.layers.pdl import wait_for_previous
from ft.moe.kernels import int_dot
from ft.moe.kernels.fp4_decode import decode_f32
from ft.moe.kernels.fp4_words import INPUT_BY, code, gate_up_words, input_pair


@triton.jit
def _rows(b, scale, n, k0, s_bn, s_sn, nmask, K, FP4: tl.constexpr, EVEN_K: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # weight rows n, inputs k0 .. k0+BK of one expert (b, scale: its first row) as fp32 [BN, BK]
    # (NVFP4: without the global)
    if FP4:
        kb = tl.arange(0, BLOCK_K // 2)
        ks = tl.arange(0, BLOCK_K // 16)
        b_ptr = b + n[:, None].to(tl.int64) * s_bn + (k0 // 2 + kb)[None, :]
        s_ptr = scale + n[:, None].to(tl.int64) * s_sn + (k0 // 16 + ks)[None, :]
        if EVEN_K:
            bmask = nmask[:, None]
            smask = nmask[:, None]
        else:  # K is a multiple of 16, so whole bytes and whole scale blocks are in or out
            bmask = nmask[:, None] & (kb[None, :] < (K - k0) // 2)
            smask = nmask[:, None] & (ks[None, :] < (K - k0) // 16)
        # fp32 straight from the codes: the products are exact in bf16 too, so skipping the
        # bf16 rounding the MMA path needs changes no bit
        w = decode_f32(
            tl.load(b_ptr, mask=bmask, other=0), tl.load(s_ptr, mask=smask, other=0), BLOCK_N, BLOCK_K
        )
    else:
        kk = tl.arange(0, BLOCK_K)
        b_ptr = b + n[:, None].to(tl.int64) * s_bn + (k0 + kk)[None, :]
        if EVEN_K:
            w = tl.load(b_ptr, mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(b_ptr, mask=nmask[:, None] & (kk[None, :] < K - k0), other=0.0)
    return w.to(tl.float32)  # bf16 x bf16 products are exact in fp32, as in the MMA


@triton.jit
def _expert(e, b, scale, glob, host_b, host_scale, host_glob, s_be, s_se, s_ge, HOST: tl.constexpr):
    # (weights or codes, scales, globals) of expert row e; with HOST a negative e is row -e - 1 of
    # the host store (pinned memory the kernel reads over PCIe), whose layout is the slots'
    if HOST:
        on_host = e < 0
        r = tl.where(on_host, -e - 1, e)
        return (
            tl.where(on_host, host_b, b) + r * s_be,
            tl.where(on_host, host_scale, scale) + r * s_se,
            tl.where(on_host, host_glob, glob) + r * s_ge,
        )
    return b + e * s_be, scale + e * s_se, glob + e * s_ge


@triton.jit
def _plain_rows(b, n, k0, s_bn, nmask, K, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # rows of a 16-bit weight (a shared expert's, beside a bank of either format) as fp32 [BN, BK]
    return _rows(b, b, n, k0, s_bn, s_bn, nmask, K, False, EVEN_K, BLOCK_N, BLOCK_K)


@triton.jit
def _inputs(a_row, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(a_row + k0 + kk).to(tl.float32)[None, :]
    return tl.load(a_row + k0 + kk, mask=kk < K - k0, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _plain_gate_up(x_row, rows, stride, n, N, nmask, K, LOOP_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # (gate, up) [BN] of 16-bit rows n and n + N (the up rows sit N below the gate rows) times x_row
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # per-lane partial sums, reduced after the loop
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        xin = _inputs(x_row, k0, K, EVEN_K, BLOCK_K)
        gate += _plain_rows(rows, n, k0, stride, nmask, K, EVEN_K, BLOCK_N, BLOCK_K) * xin
        up += _plain_rows(rows, n + N, k0, stride, nmask, K, EVEN_K, BLOCK_N, BLOCK_K) * xin
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _gate_up_kernel(
    x, xq, xf, b, b_scale, b_global, host_b, host_scale, host_global, shared_b, act, topk_ids, N, K,
    s_xt, s_qt, s_ft, s_be, s_bn, s_se, s_sn, s_ge, s_hn, s_at, s_it, s_ik, unfold,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr = 1, HOST: tl.constexpr = False,
    PLANES: tl.constexpr = False, USE_PDL: tl.constexpr = False, SHARED_BLOCK_K: tl.constexpr = 0,
    INT_DOT: tl.constexpr = False, ASM: tl.constexpr = True, UNROLL: tl.constexpr = 1,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    gate_up_tile(
        tl.program_id(0), tl.program_id(1), x, xq, xf, b, b_scale, b_global, host_b, host_scale, host_global,
        shared_b, act, topk_ids, N, K, s_xt, s_qt, s_ft, s_be, s_bn, s_se, s_sn, s_ge, s_hn, s_at, s_it, s_ik,
        unfold, TOPK, SHARED, FP4, EVEN_K, BLOCK_N, BLOCK_K, LOOP_STAGES, HOST, PLANES, SHARED_BLOCK_K,
        INT_DOT, ASM, UNROLL,
    )  # fmt: skip


@triton.jit
def gate_up_tile(
    p, block, x, xq, xf, b, b_scale, b_global, host_b, host_scale, host_global, shared_b, act, topk_ids, N, K,
    s_xt, s_qt, s_ft, s_be, s_bn, s_se, s_sn, s_ge, s_hn, s_at, s_it, s_ik, unfold,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr, HOST: tl.constexpr,
    PLANES: tl.constexpr, SHARED_BLOCK_K: tl.constexpr, INT_DOT: tl.constexpr, ASM: tl.constexpr,
    UNROLL: tl.constexpr = 1,
):  # fmt: skip
    # act[p, n] = silu(gate) · up for pair p = (tok, slot), BLOCK_N rows n of I (up rows are N below)
    # in row block ``block``; with SHARED, slot TOPK of each token is the shared expert: bf16 rows
    # shared_b, row stride s_hn
    tok = p // (TOPK + SHARED)
    slot = p % (TOPK + SHARED)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    x_row = x + tok.to(tl.int64) * s_xt
    if not FP4:  # one loop, outside any branch (what the pipeliner takes): a shared expert's rows
        # differ from a routed expert's only in where they start and their stride
        e = tl.load(topk_ids + tok * s_it + slot * s_ik, mask=slot < TOPK, other=0).to(tl.int64)
        rows = _expert(e, b, b, b, host_b, host_b, host_b, s_be, s_be, s_be, HOST)[0]
        if SHARED:
            rows, stride = tl.where(slot == TOPK, shared_b, rows), tl.where(slot == TOPK, s_hn, s_bn)
        else:
            stride = s_bn
        g, u = _plain_gate_up(x_row, rows, stride, n, N, nmask, K, LOOP_STAGES, EVEN_K, BLOCK_N, BLOCK_K)
    else:  # NVFP4 routed rows beside bf16 shared rows: two loops
        is_shared = False
        if SHARED:  # static: without a shared expert only the routed branch below is compiled
            is_shared = slot == TOPK
        if is_shared:  # its own step (``SHARED_BLOCK_K``, 0: BLOCK_K)
            g, u = _plain_gate_up(
                x_row, shared_b, s_hn, n, N, nmask, K, LOOP_STAGES, EVEN_K, BLOCK_N, SHARED_BLOCK_K or BLOCK_K
            )
        else:
            e = tl.load(topk_ids + tok * s_it + slot * s_ik).to(tl.int64)
            b_e, s_e, g_e = _expert(
                e, b, b_scale, b_global, host_b, host_scale, host_global, s_be, s_se, s_ge, HOST
            )
            if PLANES and INT_DOT:  # int16 inputs, integer block sums (``FP4_INT_DOT``)
                gate = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
                up = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
                xq_row = xq + tok.to(tl.int64) * s_qt
                xf_row = xf + tok.to(tl.int64) * s_ft
                # UNROLL > 1: ptxas may issue a later step's loads before this step's products
                for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL):
                    g_lo, g_hi, sg = int_dot.fp4_blocks(
                        b_e, s_e, n, k0, s_bn, s_sn, nmask, K, EVEN_K, BLOCK_N, BLOCK_K
                    )
                    u_lo, u_hi, su = int_dot.fp4_blocks(
                        b_e, s_e, n + N, k0, s_bn, s_sn, nmask, K, EVEN_K, BLOCK_N, BLOCK_K
                    )
                    p0, p1, p2, p3, p4, p5, p6, p7, factor = int_dot.int_inputs(
                        xq_row, xf_row, k0, K, EVEN_K, BLOCK_K
                    )
                    ig = int_dot.int_block_sums(g_lo, g_hi, p0, p1, p2, p3, p4, p5, p6, p7, ASM)
                    iu = int_dot.int_block_sums(u_lo, u_hi, p0, p1, p2, p3, p4, p5, p6, p7, ASM)
                    gate += ig.to(tl.float32) * (sg * factor)
                    up += iu.to(tl.float32) * (su * factor)
            elif PLANES:  # codes as words, a block's scale once (``FP4_PLANES``)
                gate = tl.zeros([BLOCK_N, BLOCK_K // 16, 1], tl.float32)
                up = tl.zeros([BLOCK_N, BLOCK_K // 16, 1], tl.float32)
                for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
                    wg, sg, wu, su = gate_up_words(
                        b_e, s_e, n, N, k0, s_bn, s_sn, nmask, K, EVEN_K, BLOCK_N, BLOCK_K
                    )
                    bg = tl.zeros([BLOCK_N, BLOCK_K // 16, 2], tl.float32)  # the blocks' sums, unscaled
                    bu = tl.zeros([BLOCK_N, BLOCK_K // 16, 2], tl.float32)
                    for q in tl.static_range(4):
                        lo, hi = input_pair(x_row, k0, q, K, EVEN_K, BLOCK_K, INPUT_BY)
                        bg += code(wg, 2 * q) * lo  # e2m1 · x · 2^-62: normal
                        bg += code(wg, 2 * q + 1) * hi
                        bu += code(wu, 2 * q) * lo
                        bu += code(wu, 2 * q + 1) * hi
                    gate += tl.sum(bg, axis=2, keep_dims=True) * sg  # scale · 2^40
                    up += tl.sum(bu, axis=2, keep_dims=True) * su
                gate = tl.sum(gate, axis=2)
                up = tl.sum(up, axis=2)
            else:
                gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # per-lane partial sums
                up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
                for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
                    xin = _inputs(x_row, k0, K, EVEN_K, BLOCK_K)
                    gate += _rows(b_e, s_e, n, k0, s_bn, s_sn, nmask, K, FP4, EVEN_K, BLOCK_N, BLOCK_K) * xin
                    # the up rows sit N rows below the gate rows of the same expert
                    w_up = _rows(b_e, s_e, n + N, k0, s_bn, s_sn, nmask, K, FP4, EVEN_K, BLOCK_N, BLOCK_K)
                    up += w_up * xin
            g = tl.sum(gate, axis=1)
            u = tl.sum(up, axis=1)
            g_ptr = g_e + n  # the rows' globals
            g *= tl.load(g_ptr, mask=nmask, other=0.0) * unfold
            u *= tl.load(g_ptr + N, mask=nmask, other=0.0) * unfold
    out = g * tl.sigmoid(g) * u
    tl.store(act + p.to(tl.int64) * s_at + n, out.to(act.dtype.element_ty), mask=nmask)
