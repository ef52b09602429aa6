"""Fused RMSNorm in Triton: one program per row, fp32 statistics, optional residual add.

    rms_norm(x, w)              = x / rms(x) * w            (or * (1 + w) when zero_centred)
    rms_norm(x, w, residual=r)  -> (rms_norm(x + r, w), x + r)

The residual sum is rounded to x's dtype before it is normalised, so the fused form equals the
unfused ``h = x + r; norm(h)`` of ``ft.layers.norm.RMSNorm`` bit for bit up to fp32 reduction
order. Rows must be contiguous in the last dimension. Not here: the gated GDN norm, layer norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x,
    r,
    w,
    out,
    res_out,
    D,
    eps,
    s_x,
    s_r,
    s_o,
    s_ro,
    ZERO_CENTERED: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    h = tl.load(x + row * s_x + d, mask=mask, other=0.0)
    if HAS_RES:
        h = h.to(tl.float32) + tl.load(r + row * s_r + d, mask=mask, other=0.0).to(tl.float32)
        h = h.to(res_out.dtype.element_ty)
        tl.store(res_out + row * s_ro + d, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, 0) / D + eps)
    wf = tl.load(w + d, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        wf = wf + 1.0
    tl.store(out + row * s_o + d, (hf * inv * wf).to(out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    residual: torch.Tensor | None = None,
):
    """x [..., D], weight [D] -> out [..., D]; with residual [..., D] -> (out, x + residual)."""
    d = x.shape[-1]
    assert x.is_cuda and weight.shape == (d,), f"weight {tuple(weight.shape)} does not fit x [..., {d}]"
    assert residual is None or residual.shape == x.shape, (
        f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}"
    )
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = x2 if residual is None else residual.reshape(-1, d)
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = out if residual is None else torch.empty_like(out)
    block = triton.next_power_of_2(d)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            res_out,
            d,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            ZERO_CENTERED=zero_centered,
            HAS_RES=residual is not None,
            BLOCK_D=block,
            num_warps=min(16, max(1, block // 256)),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)
