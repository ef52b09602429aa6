"""Reference MoE in plain PyTorch: for each expert hit, gather its tokens and run the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_tokens: int | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [T, k] -> [T, H].
    One path at every size, so ``batch_tokens`` changes nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], w13[e])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, w2[e]).float() * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)
