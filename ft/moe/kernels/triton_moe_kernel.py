"""The bf16/fp16 fused MoE's grouped GEMM kernel, as ``triton_moe`` launches it: one program a
BLOCK_M run of sorted (token, k) pairs sharing an expert and BLOCK_N output columns, gate and up
with SwiGLU fused (``SWIGLU``) or down times the routing weight (``MUL_W``). Not here: the maths,
tiles and launches (``triton_moe``), the tile pieces every MMA kernel shares (``grouped_tiles``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.layers.pdl import wait_for_previous
from ft.moe.kernels.grouped_tiles import pair_tile, store_pairs, tile_pairs


# a call's pair count, where its weights and row maps start (slices of a batch's): one variant for all
@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _grouped_gemm_kernel(
    a,
    b,
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
    s_cm,
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
):
    wait_for_previous(USE_PDL)
    # c[rows] = f(a[rows] @ b[e].T) for one BLOCK_M run of (token, k) pairs that share expert e
    pid_m, pid_n = pair_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    e, rows, rmask, a_rows, n, nmask = tile_pairs(
        pid_m, pid_n, sorted_ids, block_expert, num_pairs, N, a_map, TOPK, A_PER_TOKEN, BLOCK_M, BLOCK_N,
        A_MAP,
    )  # fmt: skip
    kk = tl.arange(0, BLOCK_K)
    a_ptr = a + a_rows[:, None].to(tl.int64) * s_am + kk[None, :]  # [BM, BK]
    b_ptr = b + e * s_be + n[None, :].to(tl.int64) * s_bn + kk[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            at = tl.load(a_ptr, mask=rmask[:, None], other=0.0)
            bt = tl.load(b_ptr, mask=nmask[None, :], other=0.0)
        else:
            kmask = kk < K - k0
            at = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
            bt = tl.load(b_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(at, bt, acc)
        if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
            if EVEN_K:
                ut = tl.load(b_ptr + N * s_bn, mask=nmask[None, :], other=0.0)
            else:
                ut = tl.load(b_ptr + N * s_bn, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc_up = tl.dot(at, ut, acc_up)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    store_pairs(acc, c, topk_w, rows, rmask, n, nmask, s_cm, c_map, MUL_W, C_MAP)
