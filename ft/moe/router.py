"""Top-k softmax router, replicated on every rank so every rank routes identically.

With a sigmoid-gated shared expert the router's weight carries one more row, the shared
expert's gate (``shared_expert_gate`` on disk, a part of the fused weight when loading), so one
[T, H] x [H, E + 1] GEMM gives both the routing logits and the gate logit (a [T, H] x [H, 1]
GEMM of its own is two kernels and their launch gaps per layer).

``route`` is the reference in torch ops; on a GPU the router runs ``triton_router.softmax_topk``,
one kernel with the same results (ids equal, weights to fp32 rounding) instead of about six.
Both read the first E columns of the logits as a strided view, without a copy. With
``triton_router_gemv.FUSED_ROUTER`` on (the default, up to its ``MAX_TOKENS``) a decode batch's
GEMV and top-k are one launch instead: logits rounded once to x's dtype as ``dense``'s (the
same bits when ``dense`` splits K the same way, ``triton_gemv.SPLIT_K``), the same top-k maths.

The weight's storage is padded to a multiple of ``ALIGN_ROWS`` rows (513 -> 520 for Qwen3-Next),
so the logits' rows are 16-byte aligned: with a 513-wide output cuBLAS falls back to an unaligned
sm75 kernel, 225 us for an 8k-token prefill (H200, 2026-11-30). Decode batches (up to
``PAD_MIN_TOKENS``) and CPUs multiply the parameter itself, the unpadded [E + 1, H] view of that
storage; the pad rows are zeros nobody reads.
"""

from __future__ import annotations

import torch
from torch import nn

from ft.layers.linear import Part, PartsLoader, dense
from ft.layers.loading import new_param
from ft.utils import round_up

try:  # one fused kernel instead of softmax, top-k, sum and divide; used for tensors on a GPU
    from ft.moe.kernels import triton_router_gemv
    from ft.moe.kernels.triton_router import softmax_topk
except ImportError:  # no triton (CPU-only installs)
    softmax_topk = triton_router_gemv = None

ALIGN_ROWS = 8  # bf16 logits rows a multiple of 16 bytes
# Above this many tokens the GEMM runs over the padded rows: H200, 2026-11-30, 513 vs 520 rows:
# 52.9 vs 22.8 us at T = 1,024 and 250.6 vs 32.0 us at T = 8,000 (eager, one run each)
PAD_MIN_TOKENS = 64


class TopKRouter(nn.Module):
    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, shared_gate: bool = False
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.shared_gate = top_k, renormalize, shared_gate
        rows = [Part(num_experts, num_experts, 0)] + (
            [Part(1, 1, 0)] if shared_gate else []
        )  # whole everywhere
        n = num_experts + shared_gate
        padded = new_param(round_up(n, ALIGN_ROWS), hidden_size).data
        padded[n:].zero_()
        self.weight = nn.Parameter(padded[:n], requires_grad=False)  # [E, H], or [E + 1, H]: shared gate last
        self.weight.weight_loader = PartsLoader(rows)
        self._padded = padded  # not a parameter: the same storage, seen whole by the GEMM

    def forward(
        self, x: torch.Tensor, blocks: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64, largest weight first;
        the shared expert's gate logit [T, 1], or None without a shared gate). ``blocks``: the
        fused router also leaves x's int16 blocks on x for the MoE GEMV (``triton_router_gemv``)."""
        fused = triton_router_gemv
        if fused is not None and fused.takes_fused(x, self.weight):  # a decode batch: one launch
            return fused.router_topk(x, self.weight, self.top_k, self.renormalize, self.shared_gate, blocks)
        e = self.weight.shape[0] - self.shared_gate
        # the padded storage for prefill-sized batches on a GPU, unless the parameter was given new
        # storage since; decode batches keep the parameter (at T = 1 the 520-row GEMV timed 23.3 us
        # against 20.7), and so does a CPU (16 rows there change the rounding with the batch size)
        padded = (
            x.is_cuda and x.shape[0] > PAD_MIN_TOKENS and self._padded.data_ptr() == self.weight.data_ptr()
        )
        w = self._padded if padded else self.weight
        logits = dense(x, w)  # [T, E (+ 1)], or that padded to a multiple of 8
        shared_logit = logits[:, e : e + 1] if self.shared_gate else None
        logits = logits[:, :e]  # a view: rows stay padded apart
        if logits.is_cuda and softmax_topk is not None:
            return *softmax_topk(logits, self.top_k, self.renormalize), shared_logit
        return *route(logits, self.top_k, self.renormalize), shared_logit


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
