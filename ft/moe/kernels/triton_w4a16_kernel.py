"""The W4A16 fused MoE's grouped GEMM kernel in Triton, as ``triton_w4a16`` launches it: one
program a BLOCK_M run of sorted (token, k) pairs sharing an expert and BLOCK_N output columns, the
expert's NVFP4 codes decoded a K step at a time in registers (``fp4_decode.decode``, or with
``LUT`` the PTX byte tables, ``decode_lut``, the activations read in that decode's order), bf16
MMAs with fp32 accumulation, the rows' globals applied after the loop, then SwiGLU (``SWIGLU``) or
the routing weight (``MUL_W``). Not here: the maths, switches, tiles and launch (``triton_w4a16``),
the Gluon kernel (``gluon_w4a16_kernel``), the tile pieces every MMA kernel shares
(``grouped_tiles``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.layers.pdl import wait_for_previous
from ft.moe.kernels.fp4_decode import decode, decode_lut, lut_dots
from ft.moe.kernels.grouped_tiles import pair_tile, store_pairs, tile_pairs


# a call's pair count, where its weights and row maps start (slices of a batch's): one variant for all
@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _w4a16_gemm_kernel(
    a,
    b,
    b_scale,
    b_global,
    c,
    topk_w,
    sorted_ids,
    block_expert,
    num_padded,
    EM,
    N,
    K,
    num_pairs,
    s_am,
    s_be,
    s_bn,
    s_se,
    s_sn,
    s_ge,
    s_cm,
    unfold,
    a_map,
    c_map,
    TOPK: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_MAP: tl.constexpr = False,
    C_MAP: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    LUT: tl.constexpr = False,
    ASM: tl.constexpr = True,
):
    wait_for_previous(USE_PDL)
    # c[rows] = f(g[e] · (a[rows] @ W[e].T)) for one BLOCK_M run of (token, k) pairs sharing expert e
    pid_m, pid_n = pair_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    e, rows, rmask, a_rows, n, nmask = tile_pairs(
        pid_m, pid_n, sorted_ids, block_expert, num_pairs, N, a_map, TOPK, A_PER_TOKEN, BLOCK_M, BLOCK_N,
        A_MAP,
    )  # fmt: skip
    kk = tl.arange(0, BLOCK_K)
    kb = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    a_ptr = a + a_rows[:, None].to(tl.int64) * s_am + kk[None, :]  # [BM, BK]
    b_ptr = b + e * s_be + n[:, None].to(tl.int64) * s_bn + kb[None, :]  # [BN, BK/2] packed codes
    s_ptr = b_scale + e * s_se + n[:, None].to(tl.int64) * s_sn + ks[None, :]  # [BN, BK/16]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SWIGLU:
        acc_up = tl.zeros_like(acc)
    if LUT:  # ``decode_lut``: the activations read in its inputs' order, two half-K products a step
        kh = tl.arange(0, BLOCK_K // 2)
        ka = (kh // 4) * 8 + kh % 4  # wa's inputs; wb's are 4 further
        a_lut = a + a_rows[:, None].to(tl.int64) * s_am + ka[None, :]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                m0 = rmask[:, None]
                m1 = m0
                bmask = nmask[:, None]
                smask = bmask
            else:  # K is a multiple of 16, so whole bytes and whole scale blocks are in or out
                left = K - k0
                m0 = rmask[:, None] & (ka[None, :] < left)
                m1 = rmask[:, None] & (ka[None, :] + 4 < left)
                bmask = nmask[:, None] & (kb[None, :] < left // 2)
                smask = nmask[:, None] & (ks[None, :] < left // 16)
            a0 = tl.load(a_lut, mask=m0, other=0.0)
            a1 = tl.load(a_lut + 4, mask=m1, other=0.0)
            codes, scales = tl.load(b_ptr, mask=bmask, other=0), tl.load(s_ptr, mask=smask, other=0)
            wa, wb = decode_lut(codes, scales, BLOCK_N, BLOCK_K, ASM)
            acc = lut_dots(a0, a1, wa, wb, acc)
            if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
                ua, ub = decode_lut(
                    tl.load(b_ptr + N * s_bn, mask=bmask, other=0),
                    tl.load(s_ptr + N * s_sn, mask=smask, other=0),
                    BLOCK_N,
                    BLOCK_K,
                    ASM,
                )
                acc_up = lut_dots(a0, a1, ua, ub, acc_up)
            a_lut += BLOCK_K
            b_ptr += BLOCK_K // 2
            s_ptr += BLOCK_K // 16
    else:
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                at = tl.load(a_ptr, mask=rmask[:, None], other=0.0)
                w = decode(
                    tl.load(b_ptr, mask=nmask[:, None], other=0),
                    tl.load(s_ptr, mask=nmask[:, None], other=0),
                    BLOCK_N,
                    BLOCK_K,
                )
            else:  # K is a multiple of 16, so whole bytes and whole scale blocks are in or out
                left = K - k0
                at = tl.load(a_ptr, mask=rmask[:, None] & (kk[None, :] < left), other=0.0)
                bmask = nmask[:, None] & (kb[None, :] < left // 2)
                smask = nmask[:, None] & (ks[None, :] < left // 16)
                w = decode(
                    tl.load(b_ptr, mask=bmask, other=0), tl.load(s_ptr, mask=smask, other=0), BLOCK_N, BLOCK_K
                )
            acc = tl.dot(at, tl.trans(w), acc)
            if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
                if EVEN_K:
                    u = decode(
                        tl.load(b_ptr + N * s_bn, mask=nmask[:, None], other=0),
                        tl.load(s_ptr + N * s_sn, mask=nmask[:, None], other=0),
                        BLOCK_N,
                        BLOCK_K,
                    )
                else:
                    u = decode(
                        tl.load(b_ptr + N * s_bn, mask=bmask, other=0),
                        tl.load(s_ptr + N * s_sn, mask=smask, other=0),
                        BLOCK_N,
                        BLOCK_K,
                    )
                acc_up = tl.dot(at, tl.trans(u), acc_up)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K // 2
            s_ptr += BLOCK_K // 16
    g_ptr = b_global + e * s_ge + n
    acc = acc * (tl.load(g_ptr, mask=nmask, other=0.0) * unfold)[None, :]
    if SWIGLU:
        acc_up = acc_up * (tl.load(g_ptr + N, mask=nmask, other=0.0) * unfold)[None, :]
        acc = acc * tl.sigmoid(acc) * acc_up
    store_pairs(acc, c, topk_w, rows, rmask, n, nmask, s_cm, c_map, MUL_W, C_MAP)
