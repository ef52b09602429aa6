"""Routed experts computed on the CPU, straight from the host store.

``cpu_experts`` runs the (token, k) pairs routed to some experts through the CPU kernel that the
selection table picks for the bank's format on the CPU (torch matmuls for bf16; NVFP4 experts
dequantised first), reading the host store's rows in place, and returns their sum per token on
the model's device. The ``cpu`` backend sends every pair there; attention, GDN, the router and
the shared expert stay on the GPU. ``hybrid`` sends only the misses, never a static expert of a
lean store (always resident, so always a hit). The ``cpu`` backend needs every expert in the host
store, so the runtime refuses it a lean one.

Under a CUDA-graph decode the work sits behind a ``split_point``: the graph leaves an output
buffer that the host fills at the break, and the next segment adds it.
"""

from __future__ import annotations

import numpy as np
import torch

from ft.moe.backends.graph_split import split_point
from ft.moe.backends.host_store import HostStore
from ft.moe.backends.pairs import Pairs, pair_terms, upload_pairs
from ft.moe.backends.slot_map import unique
from ft.moe.backends.staging import Shared
from ft.moe.kernels.select import select_moe_kernel
from ft.moe.kernels.torch_ref import sum_in_routing_order

_CPU_KERNELS: dict[str, object] = {}


def cpu_kernel(fmt: str):
    if fmt not in _CPU_KERNELS:
        _CPU_KERNELS[fmt] = select_moe_kernel(fmt, "cpu")[1]
    return _CPU_KERNELS[fmt]


def cpu_experts(
    bank, store: HostStore, x: torch.Tensor, weights: torch.Tensor, ids_h: np.ndarray, experts: np.ndarray
) -> tuple[torch.Tensor, int]:
    """Sum over the pairs routed to ``experts`` -> ([T, H] on x's device, pairs computed): each
    token's terms added in routing order, as the resident kernels and ``Terms`` add them."""
    t, k = ids_h.shape
    terms = torch.zeros(t * k, x.shape[1], dtype=torch.float32)  # [T*k, H] on the host, by pair
    pairs = Pairs(ids_h, store.num_experts).of(experts, store.rows(experts))
    ((tok, pair_w, rows, pair),) = upload_pairs([pairs], weights.cpu())  # the kernel runs here
    if len(tok) > 0:
        terms[pair] = pair_terms(CpuKernel(bank), store.tensors, x.cpu(), tok, pair_w, rows).float()
    out = sum_in_routing_order(terms.view(t, k, -1))
    return out.to(device=x.device, dtype=x.dtype), len(tok)


class CpuKernel:
    """The bank as ``pair_terms`` sees it, with the CPU kernel of its format."""

    def __init__(self, bank) -> None:
        self.kernel, self.kernel_weights = cpu_kernel(bank.format), bank.kernel_weights
        self.num_experts = bank.num_experts


class CpuBackend:
    name = "cpu"

    def __init__(self, store: HostStore, shared: Shared, first: bool) -> None:
        self.store, self.shared, self.first = store, shared, first
        self.map = self.cache = self.prefetch = None
        self.experts_seen = 0  # the misses it counts: every expert a batch routes to (no map)

    def __call__(self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)  # [T, H], filled on the host (at a graph break when captured)
        split_point(lambda: self._compute(bank, x, weights, ids, y))
        return y

    def _compute(self, bank, x, weights, ids, y) -> None:
        ids_h = ids.cpu().numpy()
        if self.first:
            self.shared.step += 1
        experts = unique(ids_h, self.store.num_experts)
        self.experts_seen += len(experts)
        part, pairs = cpu_experts(bank, self.store, x, weights, ids_h, experts)
        self.shared.cpu_pairs += pairs
        y.copy_(part)
