"""Fused MoE for NVFP4 expert banks at decode sizes (a few tokens), W4A16 as GEMVs: no token->expert
sort, no MMA tiles, one program per (token, slot) pair and BLOCK_N weight rows.

Same contract as ``triton_w4a16.fused_moe_w4a16``, which dispatches here for small T. With p the
pair (t, j), e = ids[t, j] its expert and ``W = e2m1(code) · scale`` decoded in registers by the
same ``_decode`` (exact in bf16, up to the folded 2^-22):

    act[p, n] = silu(g_gate[e, n] · x[t]·W_gate[e, n]) · (g_up[e, n] · x[t]·W_up[e, n])   # [T*k, I]
    y[p, n]   = weights[t, j] · g_down[e, n] · act[p]·W_down[e, n]                        # [T*k, H]
    out[t]    = sum_j y[(t, j)]                                                           # [T, H]

Each dot product is an fp32 multiply-accumulate of BLOCK_K-wide chunks kept per lane and reduced
once with ``tl.sum`` (no ``tl.dot``): the MMA path pads each expert's one or two decode tokens to
a 16-row tile, this one reads every weight byte once per pair that needs it and does no padded
work. ``act`` and ``y`` are rounded to bf16 where the MMA path rounds them, so the two differ only
in the fp32 summation order. Not here: large T (an expert hit by many tokens is decoded once per
token here, once per tile there), fp16 activations, W4A4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.moe.kernels.triton_combine import sum_topk
from ft.moe.kernels.triton_w4a16 import UNFOLD, _decode, check_operands
from ft.quant.nvfp4 import NVFP4Tensor

BLOCK_N = 16  # weight rows per program: a T=1, k=10 decode is 10 x 32 gate/up and 10 x 128 down programs
MAX_BLOCK_K = 256  # input elements per step: 128 code bytes and 16 scale bytes of each row


@triton.jit
def _w4a16_gemv_kernel(
    a,
    b,
    b_scale,
    b_global,
    c,
    topk_w,
    topk_ids,
    N,
    K,
    s_am,
    s_be,
    s_bn,
    s_se,
    s_sn,
    s_ge,
    s_cm,
    s_wt,
    s_wk,
    s_it,
    s_ik,
    unfold,
    TOPK: tl.constexpr,
    SWIGLU: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # c[p, n] for pair p = (tok, slot) and BLOCK_N rows n of expert e = ids[tok, slot]:
    #   SWIGLU: silu(g[e, n] · a[tok]·W[e, n]) · (g[e, N+n] · a[tok]·W[e, N+n])   (a = x, N = I)
    #   else:   weights[tok, slot] · g[e, n] · a[p]·W[e, n]                      (a = act, N = H)
    p = tl.program_id(0)
    tok = p // TOPK
    slot = p % TOPK
    e = tl.load(topk_ids + tok * s_it + slot * s_ik).to(tl.int64)
    if SWIGLU:
        a_row = tok
    else:
        a_row = p
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    kb = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    a_ptr = a + a_row.to(tl.int64) * s_am + kk  # [BK]
    b_ptr = b + e * s_be + n[:, None].to(tl.int64) * s_bn + kb[None, :]  # [BN, BK/2] packed codes
    s_ptr = b_scale + e * s_se + n[:, None].to(tl.int64) * s_sn + ks[None, :]  # [BN, BK/16]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # per-lane partial sums, reduced after the loop
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            at = tl.load(a_ptr)
            bmask = nmask[:, None]
            smask = nmask[:, None]
        else:  # K is a multiple of 16, so whole bytes and whole scale blocks are in or out
            left = K - k0
            at = tl.load(a_ptr, mask=kk < left, other=0.0)
            bmask = nmask[:, None] & (kb[None, :] < left // 2)
            smask = nmask[:, None] & (ks[None, :] < left // 16)
        at = at.to(tl.float32)[None, :]  # [1, BK]
        w = _decode(
            tl.load(b_ptr, mask=bmask, other=0), tl.load(s_ptr, mask=smask, other=0), BLOCK_N, BLOCK_K
        )
        acc += w.to(tl.float32) * at  # bf16 x bf16 products are exact in fp32, as in the MMA
        if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
            u = _decode(
                tl.load(b_ptr + N * s_bn, mask=bmask, other=0),
                tl.load(s_ptr + N * s_sn, mask=smask, other=0),
                BLOCK_N,
                BLOCK_K,
            )
            acc_up += u.to(tl.float32) * at
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K // 2
        s_ptr += BLOCK_K // 16
    g_ptr = b_global + e * s_ge + n
    out = tl.sum(acc, axis=1) * (tl.load(g_ptr, mask=nmask, other=0.0) * unfold)  # [BN]
    if SWIGLU:
        up = tl.sum(acc_up, axis=1) * (tl.load(g_ptr + N, mask=nmask, other=0.0) * unfold)
        out = out * tl.sigmoid(out) * up
    else:
        out = out * tl.load(topk_w + tok * s_wt + slot * s_wk).to(tl.float32)
    tl.store(c + p.to(tl.int64) * s_cm + n, out.to(c.dtype.element_ty), mask=nmask)


def _launch(a, w: NVFP4Tensor, c, weights, ids, n: int, k: int, swiglu: bool) -> None:
    block_k = min(MAX_BLOCK_K, max(32, triton.next_power_of_2(k)))
    scale = w.weight_scale.view(torch.uint8)  # decoded from its bits in the kernel
    _w4a16_gemv_kernel[(c.shape[0], triton.cdiv(n, BLOCK_N))](
        a,
        w.weight,
        scale,
        w.weight_scale_2,
        c,
        weights,
        ids,
        n,
        k,
        a.stride(0),
        w.weight.stride(0),
        w.weight.stride(1),
        scale.stride(0),
        scale.stride(1),
        w.weight_scale_2.stride(0),
        c.stride(0),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
        UNFOLD,
        TOPK=ids.shape[1],
        SWIGLU=swiglu,
        EVEN_K=k % block_k == 0,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        num_warps=4,
    )


def launch_moe_w4a16_gemv(
    x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Checks and launches without the device check (the Triton interpreter runs it on CPU
    tensors); returns y [T, k, H], the weighted expert outputs before the sum over k."""
    t, h = x.shape
    _, inter, topk = check_operands(x, w13, w2, weights, ids)
    assert not ids.is_floating_point() and weights.is_floating_point(), (
        f"ids must be integers and weights floats, got {ids.dtype} and {weights.dtype}"
    )
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty(t * topk, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    y = torch.empty(t * topk, h, dtype=x.dtype, device=x.device)  # [T*k, H], weighted
    if t > 0:
        _launch(x, w13, act, weights, ids, inter, h, swiglu=True)
        _launch(act, w2, y, weights, ids, h, inter, swiglu=False)
    return y.view(t, topk, h)


def fused_moe_w4a16_gemv(
    x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H] bf16; w13 codes [E, 2I, H/2], scales [E, 2I, H/16], globals [E, 2I] (gate rows then
    up rows); w2 codes [E, H, I/2], scales [E, H, I/16], globals [E, H]; weights/ids [T, k] -> [T, H].
    Graph-capturable: the grid comes from shapes, the experts are read on the device."""
    assert x.is_cuda and w13.weight.device == x.device == w2.weight.device == ids.device, (
        "fused_moe_w4a16_gemv needs CUDA tensors on one device"
    )
    return sum_topk(launch_moe_w4a16_gemv(x, w13, w2, weights, ids))  # accumulates in fp32, rounds once
