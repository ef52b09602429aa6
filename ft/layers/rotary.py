"""Rotary position embedding (NeoX rotate-half) on the first ``rotary_dim`` dims of each head,
alone (``forward``, the torch reference) or after the per-head q/k RMSNorm of QK-normed attention
(``norm_and_rotate``, one Triton kernel for CUDA tensors)."""

from __future__ import annotations

import torch
from torch import nn

from ft.layers.norm import RMSNorm

try:  # q/k norm and rotation for all heads in one kernel; used for tensors on a GPU
    from ft.layers.triton_rope import qk_norm_rope
except ImportError:  # no triton (CPU-only installs)
    qk_norm_rope = None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, d], k [T, Hkv, d], positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, r/2]
        cos = torch.cat((freqs, freqs), dim=-1).cos()[:, None, :]
        sin = torch.cat((freqs, freqs), dim=-1).sin()[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def norm_and_rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope(q_norm(q)), rope(k_norm(k))`` for q [T, Hq, d], k [T, Hkv, d] (strided views)."""
        assert (q_norm.eps, q_norm.zero_centered) == (k_norm.eps, k_norm.zero_centered), (
            "q_norm and k_norm must share eps and zero-centring"
        )
        if q.is_cuda and qk_norm_rope is not None and self.rotary_dim > 0:
            eps, zc, inv_freq = q_norm.eps, q_norm.zero_centered, self.inv_freq.float()
            return qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, inv_freq, eps, zc)
        return self(positions, q_norm(q), k_norm(k))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot, rest = x[..., :r].float(), x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = (rot * cos + rotated * sin).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
