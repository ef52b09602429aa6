"""Top-k softmax router, replicated on every rank so every rank routes identically.

``route`` is the reference in torch ops; on a GPU the router runs ``triton_router.softmax_topk``,
one kernel with the same results (ids equal, weights to fp32 rounding) instead of about six.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ft.layers.loading import new_param

try:  # one fused kernel instead of softmax, top-k, sum and divide; used for tensors on a GPU
    from ft.moe.kernels.triton_router import softmax_topk
except ImportError:  # no triton (CPU-only installs)
    softmax_topk = None


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = new_param(num_experts, hidden_size)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64), largest weight first."""
        logits = self.logits(x)  # [T, E]
        if logits.is_cuda and softmax_topk is not None:
            return softmax_topk(logits, self.top_k, self.renormalize)
        return route(logits, self.top_k, self.renormalize)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
