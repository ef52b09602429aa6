"""Fused RMSNorms in Triton, fp32 statistics, each one kernel where torch takes ~8:

    rms_norm(x, w)              = x / rms(x) * w            (or * (1 + w) when zero_centred)
    rms_norm(x, w, residual=r)  -> (rms_norm(x + r, w), x + r)
    gated_rms_norm(x, z, w)     = (x / rms(x)) * w * silu(z)                    (the GDN output)

with rms(x) = sqrt(mean(x²) + eps). Each mirrors the rounding points of the torch forward in
``ft.layers.norm``: the residual sum is rounded to x's dtype before it is normalised (so the
fused form equals ``h = x + r; norm(h)``), and the gated norm rounds x / rms(x) to x's dtype,
its product with w to the promoted dtype, then multiplies by silu(z) in fp32. Results differ
from torch only by fp32 reduction order. Rows must be contiguous in the last dimension; the
gated norm takes [N, D] or [T, H, D] views with any other strides (e.g. z split off a
projection), without copying them. Not here: layer norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous


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
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
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
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), (
        f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
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
            **pdl_args(x2),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _gated_rms_norm_kernel(
    x,
    z,
    w,
    out,
    N,
    H,
    D,
    eps,
    s_xt,
    s_xh,
    s_zt,
    s_zh,
    ROUND_MID: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    # ROWS rows per program; row n is (t, h) = divmod(n, H) of the [T, H, D] views
    n = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    t, h = n // H, n % H
    d = tl.arange(0, BLOCK_D)
    mask = (n < N)[:, None] & (d < D)[None, :]  # [ROWS, BLOCK_D]
    xf = tl.load(x + (t * s_xt + h * s_xh)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    zf = tl.load(z + (t * s_zt + h * s_zh)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y = gated_norm_rows(xf, zf, w, d, D, eps, out.dtype.element_ty, ROUND_MID)
    tl.store(out + n[:, None] * D + d[None, :], y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_rows(xf, zf, w, d, D, eps, dt: tl.constexpr, ROUND_MID: tl.constexpr):
    # (x / rms(x)) · w · silu(z) in fp32 for rows xf, zf [R, BLOCK_D] (x and z as read in dtype dt,
    # zeros past D), rounded where torch rounds: x / rms(x) to dt, its product with w too when
    # ROUND_MID (torch multiplies two tensors of x's dtype and rounds the product to it)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)  # [R]
    y = (xf * inv[:, None]).to(dt).to(tl.float32)
    y = y * tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    if ROUND_MID:
        y = y.to(dt).to(tl.float32)
    return y * (zf / (1.0 + tl.exp(-zf)))


def _as_3d(a: torch.Tensor) -> torch.Tensor:
    """[N, D] -> [N, 1, D] and [T, H, D] as is, both views; other ranks are flattened to [N, 1, D]."""
    if a.dim() == 2:
        return a[:, None]
    return a if a.dim() == 3 else a.reshape(-1, 1, a.shape[-1])


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D] (same shape, any strides but the last), weight [D] -> contiguous [..., D] in
    x's dtype: ``(rms_norm(x) · w) · silu(z)``."""
    d = x.shape[-1]
    assert x.is_cuda and weight.shape == (d,), f"weight {tuple(weight.shape)} does not fit x [..., {d}]"
    assert z.shape == x.shape, f"gate z {tuple(z.shape)} must match x {tuple(x.shape)}"
    x3, z3 = _as_3d(x), _as_3d(z)
    x3 = x3 if x3.stride(-1) == 1 else x3.contiguous()
    z3 = z3 if z3.stride(-1) == 1 else z3.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, heads = x3.shape[0] * x3.shape[1], x3.shape[1]
    block = triton.next_power_of_2(d)
    per_program = max(1, min(16, 2048 // block))
    if rows > 0:
        _gated_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
            x3,
            z3,
            weight,
            out,
            rows,
            heads,
            d,
            eps,
            x3.stride(0),
            x3.stride(1),
            z3.stride(0),
            z3.stride(1),
            ROUND_MID=torch.promote_types(x.dtype, weight.dtype) == x.dtype,
            ROWS=per_program,
            BLOCK_D=block,
            num_warps=4,
            **pdl_args(x3),
        )
    return out
