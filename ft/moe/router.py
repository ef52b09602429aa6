"""Top-k softmax router, replicated on every rank so every rank routes identically.

With a sigmoid-gated shared expert the router's weight carries one more row, the shared
expert's gate (``shared_expert_gate`` on disk, a part of the fused weight when loading), so one
[T, H] x [H, E + 1] GEMM gives both the routing logits and the gate logit (a [T, H] x [H, 1]
GEMM of its own is two kernels and their launch gaps per layer).

``route`` is the reference in torch ops; on a GPU the router runs ``triton_router.softmax_topk``,
one kernel with the same results (ids equal, weights to fp32 rounding) instead of about six.
Both read the first E columns of the logits as a strided view, without a copy.
"""

from __future__ import annotations

import torch
from torch import nn

from ft.layers.linear import Part, dense, parts_param

try:  # one fused kernel instead of softmax, top-k, sum and divide; used for tensors on a GPU
    from ft.moe.kernels.triton_router import softmax_topk
except ImportError:  # no triton (CPU-only installs)
    softmax_topk = None


class TopKRouter(nn.Module):
    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, shared_gate: bool = False
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.shared_gate = top_k, renormalize, shared_gate
        rows = [Part(num_experts, num_experts, 0)] + (
            [Part(1, 1, 0)] if shared_gate else []
        )  # whole everywhere
        self.weight = parts_param(rows, hidden_size)  # [E, H], or [E + 1, H] with the shared gate last

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64, largest weight first;
        the shared expert's gate logit [T, 1], or None without a shared gate)."""
        logits = dense(x, self.weight)  # [T, E] or [T, E + 1]
        shared_logit = None
        if self.shared_gate:
            logits, shared_logit = logits[:, :-1], logits[:, -1:]  # views: rows stay E + 1 apart
        if logits.is_cuda and softmax_topk is not None:
            return *softmax_topk(logits, self.top_k, self.renormalize), shared_logit
        return *route(logits, self.top_k, self.renormalize), shared_logit


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
