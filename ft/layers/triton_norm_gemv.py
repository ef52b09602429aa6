"""The GDN output's gated RMSNorm as the prologue of its output projection, for decode batches:

    y = out_proj( (rms_norm(o) · w) · silu(z) )        o, z [T, Hv, dv]; the norm per value head

in one launch instead of two (``triton_norm.gated_rms_norm`` then ``triton_gemv``): each program of
the GEMV normalises the input chunks it reads itself (a chunk of BLOCK_K inputs is BLOCK_K / dv
whole heads), so the normed activations never go through memory. Every program repeats the norm
of the whole row (T x Hv x dv values, a few KB read from L2), which costs less than a launch at
decode sizes. Rounding as the two kernels round: the normed value to the activations' dtype,
times w (rounded again when w's dtype does not promote, ``ROUND_MID``), times silu(z), rounded
to the activations' dtype before the product with the weight; only the fp32 order of each head's
sum of squares may differ.

``FUSED_GATED_NORM`` (``FT_FUSED_GATED_NORM=1``) is off until timed on a GPU (NOT yet run on one):
18 launches fewer a step of the 24-layer Qwen3-Next. Not here: prefill (the unfused kernels run
there), bias, M > ``triton_gemv.MAX_M``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.layers import triton_gemv
from ft.layers.pdl import pdl_args, wait_for_previous

FUSED_GATED_NORM = os.environ.get("FT_FUSED_GATED_NORM", "0") == "1"


@triton.jit
def _gated_norm_gemv_kernel(
    o, z, nw, w, out, M, N, K, eps, s_ot, s_zt, s_zh, s_wn, s_om,
    D: tl.constexpr, ROUND_MID: tl.constexpr, M_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_P)
    kk = tl.arange(0, BLOCK_K)
    nmask, mmask = n < N, m < M
    dt = o.dtype.element_ty
    acc = tl.zeros([M_P, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K a multiple of BLOCK_K, BLOCK_K of D: whole heads a step
        cols = k0 + kk
        head, d = cols // D, cols % D
        of = tl.load(o + m[:, None].to(tl.int64) * s_ot + cols[None, :], mask=mmask[:, None], other=0.0)
        of = of.to(tl.float32)  # [M_P, BK]
        zp = z + m[:, None].to(tl.int64) * s_zt + head[None, :] * s_zh + d[None, :]
        zf = tl.load(zp, mask=mmask[:, None], other=0.0).to(tl.float32)
        heads = tl.reshape(of, [M_P, BLOCK_K // D, D])
        inv = tl.rsqrt(tl.sum(heads * heads, 2) / D + eps)  # [M_P, BK/D]
        y = tl.reshape(heads * inv[:, :, None], [M_P, BLOCK_K]).to(dt).to(tl.float32)
        y = y * tl.load(nw + d).to(tl.float32)[None, :]
        if ROUND_MID:
            y = y.to(dt).to(tl.float32)
        xt = (y * (zf / (1.0 + tl.exp(-zf)))).to(dt)  # what the unfused norm would have stored
        wt = tl.load(w + n[:, None].to(tl.int64) * s_wn + cols[None, :], mask=nmask[:, None], other=0.0)
        acc += tl.dot(xt, tl.trans(wt))
    tl.store(out + m[:, None] * s_om + n[None, :], acc.to(dt), mask=mmask[:, None] & nmask[None, :])


def takes(o: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gated_norm_gemv`` runs this call: the switch on, a decode-sized batch on a GPU,
    16-bit activations and weight alike, heads that tile the GEMV's K steps."""
    t, _, d = o.shape
    block_k = triton_gemv.config(weight.shape[0])[1]
    return (
        FUSED_GATED_NORM
        and o.is_cuda
        and 0 < t <= triton_gemv.GEMV_MAX_TOKENS
        and o.dtype == weight.dtype
        and o.dtype in (torch.bfloat16, torch.float16)
        and d & (d - 1) == 0
        and block_k % d == 0
        and weight.shape[1] % block_k == 0
    )


def gated_norm_gemv(
    o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> torch.Tensor:
    """o [T, Hv, dv] (rows contiguous), z [T, Hv, dv] (a view, last dim contiguous), norm_weight
    [dv], weight [N, Hv·dv] -> [T, N] in o's dtype; checks and launches without the device check
    (the Triton interpreter runs it on CPU tensors)."""
    t, hv, d = o.shape
    n, k = weight.shape
    assert k == hv * d and z.shape == o.shape, f"o {tuple(o.shape)}, z {tuple(z.shape)}, weight [{n}, {k}]"
    assert o.stride(2) == 1 and o.stride(1) == d and z.stride(2) == 1 and weight.stride(1) == 1, (
        "o must be dense rows, z and the weight contiguous in their last dim"
    )
    assert norm_weight.shape == (d,), f"norm weight {tuple(norm_weight.shape)} is not [{d}]"
    assert t <= triton_gemv.MAX_M, f"{t} rows: at most {triton_gemv.MAX_M}"
    block_n, block_k, warps, stages = triton_gemv.config(n)
    assert block_k % d == 0 and k % block_k == 0, f"heads of {d} must tile K={k} in steps of {block_k}"
    out = torch.empty(t, n, dtype=o.dtype, device=o.device)
    _gated_norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        o, z, norm_weight, weight, out, t, n, k, eps, o.stride(0), z.stride(0), z.stride(1),
        weight.stride(0), out.stride(0), D=d,
        ROUND_MID=torch.promote_types(o.dtype, norm_weight.dtype) == o.dtype, M_P=triton_gemv.MAX_M,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_args(o),
    )  # fmt: skip
    return out
