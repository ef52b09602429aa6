"""Reference MoE in plain PyTorch: for each expert hit, gather its tokens and run the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.moe.kernels.into import Into


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_tokens: int | None = None,
    into: Into | None = None,
    batch_experts: int | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [T, k] -> [T, H].
    One path and one order at every size, so ``batch_tokens`` and ``batch_experts`` change nothing.
    ``into``: the call's tokens are rows of x, its terms go into rows of ``into.out`` (``Into``;
    gathered and scattered here)."""
    if into is not None:
        into.check(x, ids, False)
        return into.scatter(fused_moe_ref(into.gather(x), w13, w2, weights, ids))
    terms = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float32, device=x.device)  # [T, k, H]
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], w13[e])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        terms[token, slot] = F.linear(act, w2[e]).float() * weights[token, slot, None]
    return sum_in_routing_order(terms).to(x.dtype)


def sum_in_routing_order(terms: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H] fp32, a fresh contiguous tensor: each token's terms added in routing
    order, as the GPU kernels add them (``triton_combine.sum_topk``). Every CPU path sums so (this
    kernel, the cpu backend's, a streamed layer's ``Terms``): from k = 3 an order shows in fp32."""
    out = terms[:, 0].to(torch.float32, copy=True)
    for j in range(1, terms.shape[1]):
        out += terms[:, j]
    return out
