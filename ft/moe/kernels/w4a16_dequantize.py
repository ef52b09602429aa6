"""An NVFP4 expert bank dequantised to bf16 in one launch (``dequantize_bank``), for timing a
prefill path that runs the bf16 grouped GEMM on dequantised experts (tests/nvfp4/w4a16_timings.py).
Not here: the W4A16 fused MoE, which decodes its codes in registers (``triton_w4a16``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.moe.kernels.fp4_decode import UNFOLD, decode_f32
from ft.moe.kernels.w4a16_operands import check_bank
from ft.quant.nvfp4 import NVFP4Tensor


@triton.jit
def _dequantize_kernel(
    codes, scales, globals_, out, N, K, s_ce, s_cn, s_se, s_sn, s_ge, s_oe, s_on, unfold,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out[e, n, k] = bf16(e2m1 · scale · global) for one BLOCK_N x BLOCK_K tile of expert e; the
    # product is taken in fp32 as ``nvfp4.dequantize`` takes it (exact but for the global's multiply)
    e = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    nmask = n < N
    mask = nmask[:, None] & (kb[None, :] < K // 2)
    packed = tl.load(codes + e * s_ce + n[:, None].to(tl.int64) * s_cn + kb[None, :], mask=mask, other=0)
    smask = nmask[:, None] & (ks[None, :] < K // 16)
    scale = tl.load(scales + e * s_se + n[:, None].to(tl.int64) * s_sn + ks[None, :], mask=smask, other=0)
    g = tl.load(globals_ + e * s_ge + n, mask=nmask, other=0.0) * unfold
    w = decode_f32(packed, scale, BLOCK_N, BLOCK_K) * g[:, None]
    kk = k0 + tl.arange(0, BLOCK_K)
    o_ptr = out + e * s_oe + n[:, None].to(tl.int64) * s_on + kk[None, :]
    tl.store(o_ptr, w.to(tl.bfloat16), mask=nmask[:, None] & (kk[None, :] < K))


def dequantize_bank(w: NVFP4Tensor, out: torch.Tensor | None = None, block: tuple[int, int] = (64, 256)):
    """An NVFP4 bank (codes [E, N, K/2], scales [E, N, K/16], per-row globals [E, N]) as bf16
    [E, N, K], the globals folded in: ``nvfp4.dequantize``'s values rounded once to bf16, in one
    launch. ``out``: where to write (a buffer reused across layers); ``block``: (rows, inputs) a
    program. For timing a prefill path that runs the bf16 grouped GEMM on dequantised experts
    (tests/nvfp4/w4a16_timings.py)."""
    e, n, half_k = w.weight.shape
    k = 2 * half_k
    check_bank(w, e, n, k, "bank")
    out = torch.empty(e, n, k, dtype=torch.bfloat16, device=w.weight.device) if out is None else out
    assert out.shape == (e, n, k) and out.dtype == torch.bfloat16 and out.stride(-1) == 1, (
        f"out {tuple(out.shape)} {out.dtype} is not a contiguous-row bf16 [{e}, {n}, {k}]"
    )
    bn, bk = block
    scale = w.weight_scale.view(torch.uint8)
    g = w.weight_scale_2
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk), e)](
        w.weight, scale, g, out, n, k, w.weight.stride(0), w.weight.stride(1), scale.stride(0),
        scale.stride(1), g.stride(0), out.stride(0), out.stride(1), UNFOLD, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return out
