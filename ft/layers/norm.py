"""RMSNorm in fp32, plain (``x * w``) or zero-centred (``x * (1 + w)``, Qwen3-Next), optionally
fused with the residual add before it, and the gated variant of the GDN output
(``norm(o) * w * silu(z)``).

The torch code is the reference and runs on the CPU; CUDA tensors take one Triton kernel
(``ft.layers.triton_norm``) that keeps the same rounding points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ft.layers.loading import new_param

try:  # one fused kernel instead of ~8 elementwise ones; used for tensors on a GPU
    from ft.layers.triton_norm import gated_rms_norm as fused_gated_rms_norm
    from ft.layers.triton_norm import rms_norm as fused_rms_norm
except ImportError:  # no triton (CPU-only installs)
    fused_rms_norm = fused_gated_rms_norm = None


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = new_param(dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; given the residual stream, the pre-norm step ``h = x + residual`` first:
        returns ``(norm(h), h)`` with h rounded to the activations' dtype before it is normed."""
        if x.is_cuda and fused_rms_norm is not None:
            return fused_rms_norm(x, self.weight, self.eps, self.zero_centered, residual)
        if residual is None:
            return self._norm(x)
        h = x + residual
        return self._norm(h), h

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        return (rms(x, self.eps) * (1.0 + w if self.zero_centered else w)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(dim)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [..., D] -> [..., D]; z may be a strided view (a part of a projection's output)."""
        if x.is_cuda and fused_gated_rms_norm is not None:
            return fused_gated_rms_norm(x, z, self.weight, self.eps)
        y = rms(x, self.eps).to(x.dtype) * self.weight
        return (y.float() * F.silu(z.float())).to(x.dtype)
