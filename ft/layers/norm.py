"""RMSNorm in fp32, plain (``x * w``) or zero-centred (``x * (1 + w)``, Qwen3-Next), optionally
fused with the residual add before it, and the gated variant of the GDN output
(``norm(o) * w * silu(z)``).

The torch code is the reference and runs on the CPU; CUDA tensors take one Triton kernel
(``ft.layers.triton_norm``) that keeps the same rounding points.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ft.layers.loading import new_param

# Off until timed on a GPU (NOT yet run on one): a decode batch's pre-norms left to the kernel that
# reads their output (``FoldedNorm``), a launch fewer each: the input norm to the mixer's first GEMV
# (``FOLD_INPUT_NORM``, FT_FOLD_INPUT_NORM=1) and the post-attention norm to the fused router
# (``FOLD_POST_NORM``, FT_FOLD_POST_NORM=1), each for a process and the ranks it spawns. The batch-1
# census of the 80B with NVFP4 experts has 97 norm launches, 177 us of 3,052 (docs/benchmarks.md
# 2026-12-04 05:19). The folded products multiply 1 / rms after the sum (rms(h) is a factor of
# every row's products), the unfolded ones before it: their rounding differs, by an ulp of the
# normed input. What each costs instead, compiled for sm_90 (docs/benchmarks.md 2026-12-04 19:48):
# the GEMV's K step is 288 instructions at one token against the plain one's 181 (the norm's
# arithmetic on the input tile), the router's single step the same once a program.
FOLD_INPUT_NORM = os.environ.get("FT_FOLD_INPUT_NORM", "0") == "1"
FOLD_POST_NORM = os.environ.get("FT_FOLD_POST_NORM", "0") == "1"
FOLD_MAX_TOKENS = 4  # a decode batch: the GEMV's GEMV_MAX_TOKENS and the fused router's MAX_TOKENS

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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, res_out: torch.Tensor | None = None
    ):
        """``norm(x)``; given the residual stream, the pre-norm step ``h = x + residual`` first:
        returns ``(norm(h), h)`` with h rounded to the activations' dtype before it is normed
        (written into ``res_out`` when given, a contiguous tensor of x's shape and dtype)."""
        if x.is_cuda and fused_rms_norm is not None:
            return fused_rms_norm(x, self.weight, self.eps, self.zero_centered, residual, res_out)
        if residual is None:
            return self._norm(x)
        h = x + residual if res_out is None else torch.add(x, residual, out=res_out)
        return self._norm(h), h

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        return (rms(x, self.eps) * (1.0 + w if self.zero_centered else w)).to(x.dtype)


class FoldedNorm:
    """``norm(x + residual)``, a pre-norm sublayer's input, left for the first layer that reads it
    to compute inside its own kernel (``FOLD_INPUT_NORM``, ``FOLD_POST_NORM``): a decode batch's
    GEMV takes the norm's 1 / rms into its products (``triton_gemv.launch_normed_gemv``), the fused
    router also writes the normed input for the experts (``triton_router_gemv``), a launch fewer
    each. That reader writes the residual stream ``h = x + residual`` into ``h`` (allocated here,
    so the layer can pass it on at once) and, if it makes it, the normed input into ``a``; any
    other reader calls
    ``tensor()``, which runs the norm as usual (writing ``h`` too) unless ``a`` is made. It has a
    tensor's shape, dtype and device, nothing else: a sublayer takes one only if everything it
    does with its input goes through a reader of these (``takes_folded_norm``)."""

    def __init__(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> None:
        self.norm, self.x, self.residual = norm, x, residual
        self.weight, self.eps, self.zero_centered = norm.weight, norm.eps, norm.zero_centered
        self.h = torch.empty_like(x)
        self.a: torch.Tensor | None = None
        self.shape, self.dtype, self.device, self.is_cuda = x.shape, x.dtype, x.device, x.is_cuda

    def __len__(self) -> int:
        return len(self.x)

    def tensor(self) -> torch.Tensor:
        """The normed input itself, computed unless a reader has made it."""
        if self.a is None:
            self.a = self.norm(self.x, self.residual, res_out=self.h)[0]
        return self.a


def unfolded(x: torch.Tensor | FoldedNorm) -> torch.Tensor:
    """x itself, or a folded norm's input computed (``FoldedNorm.tensor``)."""
    return x.tensor() if isinstance(x, FoldedNorm) else x


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
