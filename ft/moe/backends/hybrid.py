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
hits, so the CPU never needs them (they have no host copy).

Larger batches (prefill) stream as the offload backend does. With ``FT_MOE_HYBRID_PREFILL_CPU=1``
and bf16 experts the host CPU also takes a share of the host-only experts (``CpuShare``): those with
the fewest pairs, as many as it computes in no more time than the link streams the rest
(``cpu_share``, from fixed rates, so that the split depends on the routing alone). The engine's
thread computes them once the layer's copies and kernels are issued, while the GPU streams and
computes the others; their fp32 sum joins the layer's before the shared term. Off by default: on an
H200 machine (2026-12-01, tests/gpu/profile_hybrid.py, the 80B cut to 8 layers, 77% resident, a
first prefill of each kind) it made an 8k prefill 172 ms -> 11.9 s, a worker thread then taking ~80
ms a layer for its ~2,600 pairs, the layer waiting ~65 ms of it. The rates it was sized from
(tests/gpu/cpu_expert_rate.py on that host: an expert in 135 us at T=1 and 618 at T=156, its weights
in cache, the benchmark alone on the host) predict about a tenth of that. Once a worker thread had
run a share, its torch threads (a second pool beside the engine's) slowed the whole process: on a
2-core CPU machine (tests/gpu/profile_hybrid.py on a tiny config, docs/benchmarks.md) every prefill
of 64 tokens, share on or off, took 125-189 ms, and 26-45 ms with the share on the engine's thread,
hence that thread (NOT yet timed on a GPU). Small host operators and the host memory shared with the
link's copies may cost the rest. The same profile puts this backend's decode at 2.3 ms a layer, 1.45
ms of it the CPU's misses (~2 a layer there); the offload backend's host reads are faster on these
machines (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ft.moe.backends.cpu import CpuKernel, cpu_experts
from ft.moe.backends.graph_split import capturing, split_point
from ft.moe.backends.host_route import HostRoute
from ft.moe.backends.offload import OffloadBackend, decode_only
from ft.moe.backends.pairs import Pairs, Terms, pair_terms
from ft.moe.backends.streaming import take_ahead
from ft.utils import upload

HYBRID_MAX_TOKENS = 16
PREFILL_CPU = os.environ.get("FT_MOE_HYBRID_PREFILL_CPU", "0") == "1"  # off: see the docstring
# the cost model's rates: the host CPU reading an expert's bf16 weights and its marginal TFLOPS a
# token (H200 machines' host, 16 threads, 2026-12-01: 116.8 us an expert at T=1, 166.8 at T=20),
# and the pinned host-to-device link (55.4 GB/s there); FT_MOE_CPU_RATES=GBPS,TFLOPS,LINK_GBPS.
# Fixed, not adapted to what jobs take: which experts the CPU computes (its rounding differs from
# the GPU's) then depends only on the routing, so a prompt gives the same outputs every run.
CPU_RATES = tuple(float(v) for v in os.environ.get("FT_MOE_CPU_RATES", "54,2.4,55").split(","))


def rank_rates() -> tuple[float, float, float]:
    """``CPU_RATES`` for this process: the CPU's scaled by the share of the host's cores its
    torch threads have (a tensor-parallel rank gets 1/P of them, and a 1/P shard of each expert,
    while each rank's GPU has a link of its own)."""
    gbps, tflops, link = CPU_RATES
    share = min(1.0, torch.get_num_threads() / (os.cpu_count() or 1))
    return gbps * share, tflops * share, link


def cpu_seconds(pairs: np.ndarray, expert_bytes: int, flops_per_pair: float, rates) -> np.ndarray:
    """[n + 1] the CPU's time on the first 0, 1, ..., n experts of ``pairs`` (their pair counts):
    each read once, then its pairs' products."""
    gbps, tflops, _ = rates
    each = expert_bytes / (gbps * 1e9) + pairs * flops_per_pair / (tflops * 1e12)
    return np.concatenate([[0.0], np.cumsum(each)])


def cpu_share(pairs: np.ndarray, expert_bytes: int, flops_per_pair: float, rates=CPU_RATES) -> int:
    """How many of a streamed layer's host-only experts, ``pairs`` their pair counts in ascending
    order, the CPU should compute so that the layer waits least: the m minimising max(the CPU's
    time on the first m, the link's on the other n - m)."""
    n = len(pairs)
    link = expert_bytes / (rates[2] * 1e9) * (n - np.arange(n + 1))
    return int(np.argmin(np.maximum(cpu_seconds(pairs, expert_bytes, flops_per_pair, rates), link)))


@dataclass
class CpuShare:
    """Experts of one streamed layer computed on the CPU: ``experts``, their pairs (``sel``, pair
    indices into the batch's [T*k], and ``rows``, host-store rows) and the batch rows ``tokens``
    they use; ``pairs``, the batch's pairs by expert, which the layer's GPU groups reuse. ``start``
    brings their inputs to the host; ``add_to``, called once the layer's GPU work is issued,
    computes them on this thread and writes their terms."""

    pairs: Pairs
    experts: np.ndarray
    sel: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray
    shared: object  # the layers' ``Shared``, which counts CPU pairs
    inputs: tuple | None = None  # (x rows, pair weights, pair -> row) on the host
    sel_on_device: torch.Tensor | None = None  # ``sel`` on the device

    def start(self, x: torch.Tensor, weights: torch.Tensor) -> None:
        """Only the rows the CPU needs cross to the host (one gather; the host has read the
        routing, so they are computed)."""
        k = weights.shape[1]
        idx = upload(torch.from_numpy(np.concatenate([self.tokens, self.sel])), x.device)
        self.sel_on_device = idx[len(self.tokens) :]
        x_rows = x[idx[: len(self.tokens)]].cpu()
        pair_w = weights.reshape(-1)[self.sel_on_device].unsqueeze(1).cpu()
        self.inputs = (x_rows, pair_w, torch.from_numpy(np.searchsorted(self.tokens, self.sel // k)))

    def add_to(self, bank, store, terms: Terms) -> None:
        """The pairs' terms computed on the host, on the calling thread (the engine's own: a
        worker thread ran the same job 2-2.5x slower on a 2-core machine, its torch threads a
        second pool beside the engine's), then written to their rows of ``terms``."""
        x_rows, pair_w, local = self.inputs
        y = pair_terms(CpuKernel(bank), store.tensors, x_rows, local, pair_w, torch.from_numpy(self.rows))
        self.shared.cpu_pairs += len(local)
        terms.put(self.sel_on_device, upload(y, terms.buf.device))  # no host sync on a GPU


class HybridBackend(OffloadBackend):
    name = "hybrid"
    shared_pair = False  # the CPU computes the misses: the block keeps its shared expert apart

    def __call__(self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not (capturing() or (decode_only() and len(x) <= HYBRID_MAX_TOKENS)):
            return super().__call__(bank, x, weights, ids)
        take_ahead(self)  # nothing is staged for a batch this small; drop a stale group
        pred = self._predict(x)
        y_cpu = torch.empty_like(x)  # [T, H] the misses' sum, filled on the host
        split_point(lambda: self._split_work(bank, x, weights, ids, pred, y_cpu))
        return self._cached(bank, x, weights, ids) + y_cpu

    def _cpu_share(self, bank, x, weights, route: HostRoute, host_only: np.ndarray) -> CpuShare | None:
        """The streamed layer's host-only experts with the fewest pairs that the CPU computes while
        the link streams the rest (``cpu_share``); bf16 banks only (the CPU dequantises NVFP4
        experts first, a rate not measured). Host-side only: the caller starts it
        (``CpuShare.start``) once the first staging copies are issued, and adds it
        (``CpuShare.add_to``) once the layer's GPU work is."""
        if not PREFILL_CPU or bank.format != "bf16" or len(host_only) == 0:
            return None
        ids_h = route.ids_h
        pairs = Pairs(ids_h, self.store.num_experts)
        counts = pairs.counts[host_only]
        order = np.argsort(counts, kind="stable")
        flops = 2.0 * sum(t[0].numel() for t in self.store.tensors.values())  # a pair's gate, up and down
        m = cpu_share(counts[order], self.store.layout.expert_bytes, flops, rank_rates())
        if m == 0:
            return None
        experts = np.sort(host_only[order[:m]])
        sel, rows = pairs.of(experts, self.store.rows(experts))  # their pairs, by expert
        return CpuShare(pairs, experts, sel, rows, np.unique(sel // ids_h.shape[1]), self.shared)

    def _split_work(self, bank, x, weights, ids, pred, y_cpu) -> None:
        route = self._route(ids, pred)
        experts = route.experts
        hit = self.map.classify(experts)
        self.cache.publish()  # misses -> null slot, for this step's kernel
        self.shared.transfer.wait()  # earlier copies into the hits' slots land first
        misses = experts[~hit]
        part, pairs = cpu_experts(bank, self.store, x, weights, route.ids_h, misses)
        self.shared.cpu_pairs += pairs
        y_cpu.copy_(part)
        self.copy_in(self.map.prefetch(misses))  # for later steps; published at the next call
        self._prefetch_next(route.predicted_experts)
