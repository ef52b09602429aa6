"""The hybrid backend: at small decode batches the misses run on the CPU while the hits run on
the GPU; otherwise it is the offload backend.

For a decode-only batch of at most ``HYBRID_MAX_TOKENS`` tokens:

    ids -> host; resident experts (hits) pinned; the device table maps every other expert to the
    null slot, so the GPU kernel computes the hits and adds exactly zero for the misses;
    the CPU computes the misses from the host store (``cpu.cpu_experts``) into a buffer that is
    added to the GPU's result before the layer's reduce.

A miss costs CPU time instead of a blocking PCIe copy. The missed experts are then copied into
the cache in the background (evicting unpinned slots by the policy), for later steps: the copy
is not waited for, and the table that this step's kernel reads was written before it, so the
step never uses a half-copied slot. Static experts of a lean store (``placement.py``) are always
hits, so the CPU never needs them (they have no host copy). Larger batches (prefill) use the
offload paths, where the CPU would be the bottleneck.
"""

from __future__ import annotations

import torch

from ft.moe.backends.cpu import cpu_experts
from ft.moe.backends.expert_cache import unique
from ft.moe.backends.graph_split import capturing, split_point
from ft.moe.backends.offload import OffloadBackend, decode_only

HYBRID_MAX_TOKENS = 16


class HybridBackend(OffloadBackend):
    name = "hybrid"
    shared_pair = False  # the CPU computes the misses: the block keeps its shared expert apart

    def __call__(self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not (capturing() or (decode_only() and len(x) <= HYBRID_MAX_TOKENS)):
            return super().__call__(bank, x, weights, ids)
        self._take_ahead()  # nothing is staged for a batch this small; drop a stale group
        pred = self._predict(x)
        y_cpu = torch.empty_like(x)  # [T, H] the misses' sum, filled on the host
        split_point(lambda: self._split_work(bank, x, weights, ids, pred, y_cpu))
        return self._cached(bank, x, weights, ids) + y_cpu

    def _split_work(self, bank, x, weights, ids, pred, y_cpu) -> None:
        ids_h, pred_h = self._to_host(ids, pred)
        self._begin(len(ids_h))
        experts = unique(ids_h, self.store.num_experts)
        hit = self.map.classify(experts)
        self.cache.publish()  # misses -> null slot, for this step's kernel
        self.shared.transfer.wait()  # earlier copies into the hits' slots land first
        misses = experts[~hit]
        part, pairs = cpu_experts(bank, self.store, x, weights, ids_h, misses)
        self.shared.cpu_pairs += pairs
        y_cpu.copy_(part)
        self.copy_in(self.map.prefetch(misses))  # for later steps; published at the next call
        self._prefetch_next(pred_h)
