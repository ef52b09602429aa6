"""The MoE block's small fused kernels in Triton, each one launch instead of two to four:

    sum_topk(y)                      out[t] = sum_k y[t, k]                                 [T, H]
    sum_topk(y, gate_logit, shared)  out[t] = sum_k y[t, k] + sigmoid(gate_logit[t]) · shared[t]
    gated_add(y, gate_logit, shared) out[t] = y[t] + sigmoid(gate_logit[t]) · shared[t]
    silu_and_mul(h)                  out[t] = silu(h[t, :I]) · h[t, I:]                     [T, I]

Everything is computed in fp32 and rounded once to the output dtype, so ``sum_topk`` equals
``y.sum(dim=1)`` (which accumulates bf16 in fp32 too) up to the order of the k terms, and the
other two are at least as exact as their unfused torch forms, which round every intermediate.
``gated_add`` is ``sum_topk`` over k = 1. Rows must be contiguous in the last dimension. Not
here: the routed experts' GEMMs (``triton_moe``, ``triton_w4a16``), the router (``triton_router``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous

BLOCK = 1024  # columns per program: a decode row of H = 2048 is two programs


@triton.jit
def _sum_topk_kernel(
    y,
    gate,
    shared,
    out,
    H,
    s_yt,
    s_yk,
    s_g,
    s_s,
    s_o,
    K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(y + t * s_yt + k * s_yk + h, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        g = tl.sigmoid(tl.load(gate + t * s_g).to(tl.float32))
        acc += g * tl.load(shared + t * s_s + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + t * s_o + h, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x, out, N, s_x, s_o, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < N
    gate = tl.load(x + t * s_x + n, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + t * s_x + N + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + t * s_o + n, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_sum_topk(
    y: torch.Tensor, gate_logit: torch.Tensor | None = None, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """The launch without the device check (the Triton interpreter runs it on CPU tensors)."""
    t, k, h = y.shape
    assert (gate_logit is None) == (shared is None), "gate_logit and shared come together"
    if shared is not None:
        assert shared.shape == (t, h) and shared.dtype == y.dtype, (
            f"shared {tuple(shared.shape)} {shared.dtype} is not {y.dtype} [{t}, {h}]"
        )
        assert gate_logit.numel() == t, f"gate_logit {tuple(gate_logit.shape)} is not one logit per token"
        gate_logit, shared = gate_logit.reshape(t), _rows(shared)
    y = _rows(y)
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    g, s = (y, y) if shared is None else (gate_logit, shared)  # unread when there is no shared term
    if t > 0:
        _sum_topk_kernel[(t, triton.cdiv(h, BLOCK))](
            y,
            g,
            s,
            out,
            h,
            y.stride(0),
            y.stride(1),
            g.stride(0),
            s.stride(0),
            out.stride(0),
            K=k,
            HAS_SHARED=shared is not None,
            BLOCK_H=min(BLOCK, triton.next_power_of_2(h)),
            num_warps=4,
            **pdl_args(y),
        )
    return out


def sum_topk(
    y: torch.Tensor, gate_logit: torch.Tensor | None = None, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """y [T, k, H] -> [T, H]; with gate_logit [T, 1] and shared [T, H], plus the gated shared term."""
    assert y.is_cuda and y.dim() == 3, f"sum_topk needs CUDA y [T, k, H], got {tuple(y.shape)} on {y.device}"
    return launch_sum_topk(y, gate_logit, shared)


def gated_add(y: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """y + sigmoid(gate_logit) · shared for y, shared [T, H] and gate_logit [T, 1], in one kernel."""
    assert y.is_cuda and y.dim() == 2, f"gated_add needs CUDA y [T, H], got {tuple(y.shape)} on {y.device}"
    return launch_sum_topk(y.unsqueeze(1), gate_logit, shared)


def launch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The launch without the device check (the Triton interpreter runs it on CPU tensors)."""
    two_n = x.shape[-1]
    assert two_n % 2 == 0, f"the last dim {two_n} must hold gate then up halves"
    x2 = _rows(x.reshape(-1, two_n))
    n = two_n // 2
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(BLOCK, triton.next_power_of_2(n))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, n, x2.stride(0), out.stride(0), BLOCK_N=block, num_warps=4, **pdl_args(x2)
        )
    return out.view(*x.shape[:-1], n)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate then up) -> silu(gate) · up [..., I]."""
    assert x.is_cuda, f"silu_and_mul needs a CUDA tensor, got one on {x.device}"
    return launch_silu_and_mul(x)
