"""Rotary position embedding (NeoX rotate-half) on the first ``rotary_dim`` dims of each head."""

from __future__ import annotations

import torch
from torch import nn


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
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot, rest = x[..., :r].float(), x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = (rot * cos + rotated * sin).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
