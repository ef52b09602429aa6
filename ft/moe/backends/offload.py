"""The offload backend: a layer's experts in the host store, a GPU slot cache in front of them.

At start-up every dynamic slot is filled from the host store (``SlotMap.warm``, in
``wiring.build``), so the first requests find the residency the plan reports instead of an empty
cache.

Decode batches that the bank's MoE GEMV takes (a few tokens) read missed experts from the host
store inside the kernel instead, with nothing on the host in the step (``host_reads.py``, on
unless FT_MOE_HOST_READS=0). Other decode (a decode-only batch whose distinct experts fit the
layer's slots; static experts of a lean store, ``placement.py``, are always resident, the others
need one of the S - R dynamic slots):

    ids -> host, distinct experts -> ``SlotMap.ensure`` (hits pinned, misses given victims by
    the policy) -> copies host store -> slots on the side stream -> device table written ->
    main stream waits for the copies -> kernel(x, slots, weights, table[ids])

The kernel is the bank's own, handed the slot tensors ``[S + 1, ...]`` instead of the bank and
slot ids instead of expert ids, so the routed result is exactly what the resident backend
computes. Right after, the next MoE layer's router applied to this layer's input predicts its
experts and their copies start (``prefetch.py``), a layer ahead and overlapped with this layer's
compute; a wrong guess costs bandwidth, never correctness.

Prefill (and any batch whose experts do not fit): the chunk's experts are streamed through the
staging buffers, and long batches stage the next layer's first groups ahead (``streaming.py``);
the experts an idle engine pre-staged are computed where they are (``prestage.py``).

CUDA graphs: the host work sits behind ``split_point`` (``graph_split.py``), so a captured decode
step breaks at each MoE layer to make the batch's experts resident, then replays the kernel,
which reads the device table. The engine graphs only batch sizes whose experts are sure to fit
(``bs * k <= S``); larger decode batches run eagerly. Not here: which backend or how many slots
(``runtime``), the CPU computation of misses (``hybrid``), the streamed path (``streaming``), the
staging buffers and what the layers share (``staging``), the routing as the host reads it
(``host_route``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import record_function

from ft.forward_context import get_forward_context
from ft.moe.backends import host_prefetch, host_stage, streaming
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.graph_split import capturing, split_point
from ft.moe.backends.host_prefetch import Spare, routes
from ft.moe.backends.host_reads import HostReads, route_and_count, route_rows
from ft.moe.backends.host_route import HostRoute, host_route
from ft.moe.backends.host_store import HostStore
from ft.moe.backends.prefetch import Prefetch
from ft.moe.backends.staging import Shared


def real_rows(num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] whether each row of the batch is a real token (it has a KV slot), not padding; outside
    the engine every row is real. Derived once a forward (``ForwardBatch.derived``): every
    host-read layer asks, twice with prefetch."""
    try:
        batch = get_forward_context().batch
    except RuntimeError:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    if "real_rows" not in batch.derived:
        batch.derived["real_rows"] = batch.slot_mapping[:num_tokens] >= 0
    real = batch.derived["real_rows"]
    assert len(real) == num_tokens, f"{num_tokens} rows in a forward of {len(real)}"
    return real


def decode_only() -> bool:
    try:
        return get_forward_context().batch.is_decode_only
    except RuntimeError:  # a block called outside the engine: treat as decode
        return True


class OffloadBackend:
    name = "offload"
    shared_pair = True  # takes the block's shared expert as one more GEMV pair (``SparseMoeBlock``)

    def __init__(self, store: HostStore, cache: ExpertCache | None, shared: Shared, first: bool) -> None:
        self.store, self.cache, self.shared, self.first = store, cache, shared, first
        self.map = cache.map if cache is not None else None
        self.prefetch: Prefetch | None = None  # the next MoE layer's, when prefetching
        self.next: OffloadBackend | None = None  # the next MoE layer's backend (streaming ahead)
        self.reads: HostReads | None = None  # set with host reads on (``host_reads.py``)
        self.uses: torch.Tensor | None = None  # [E + spare] this layer's row of ``reads.uses``
        self.spare: Spare | None = None  # host reads' prefetch into spare rows (``host_prefetch.py``)
        self.host_staged = False  # its last host-read call staged its host experts (``host_stage.py``)

    # ---- entry
    def __call__(
        self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: tuple | None = None
    ) -> torch.Tensor:
        if self.reads is not None and self.reads.takes(bank, x, decode_only()):
            return self._read_in_place(bank, x, weights, ids, shared)
        ahead = streaming.take_ahead(self)
        pred = self._predict(x)
        if capturing():  # the padding rows' experts are neither copied nor prefetched
            real = real_rows(len(x), x.device)
            # its prefetch runs after the next segment's launch
            split_point(lambda: self._resolve(ids, pred, real))
            return self._cached(bank, x, weights, ids, shared)
        route = self._route(ids, pred)
        experts = route.experts
        if decode_only() and self.map.fits(experts):
            prefetch = self._make_resident(experts, route.predicted_experts)
            out = self._cached(bank, x, weights, ids, shared)
            prefetch()
            return out
        with record_function("ft.offload.stream"):
            return streaming.stream(self, bank, x, weights, route, experts, ahead, shared)

    # ---- host side (eager, or at a graph break)
    def _predict(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.prefetch.predict(x) if self.prefetch is not None else None

    def _route(
        self, ids: torch.Tensor, pred: torch.Tensor | None, real: torch.Tensor | None = None
    ) -> HostRoute:
        """The batch's routing on the host (the one synchronisation of the layer), of the ``real``
        rows (None: all); the first MoE layer starts the step's slot pins."""
        with record_function("ft.offload.ids_to_host"):  # a range of profiles (profile_offload_prefill.py)
            route = host_route(ids, pred, self.store.num_experts, real)
        if self.first:
            self.shared.begin_step()
        return route

    def _resolve(
        self, ids: torch.Tensor, pred: torch.Tensor | None, real: torch.Tensor
    ) -> Callable[[], None]:
        route = self._route(ids, pred, real)
        experts = route.experts
        if not self.map.fits(experts):
            raise RuntimeError(
                f"a graphed decode batch routed to {len(experts)} experts, more than the "
                f"{self.map.num_slots} cache slots ({self.map.static} static) of a layer hold: "
                "the graph batch-size cap is wrong"
            )
        return self._make_resident(experts, route.predicted_experts)

    def _make_resident(self, experts: np.ndarray, predicted: np.ndarray | None) -> Callable[[], None]:
        """Fetch the misses and write the table; returns the next layer's prefetch, for the caller
        to run once this layer's kernel is launched (the host work then overlaps the GPU's)."""
        copies = self.map.ensure(experts)
        if copies is None:
            raise RuntimeError(f"{len(experts)} experts do not fit {self.map.num_slots} unpinned slots")
        self.copy_in(copies)
        self.cache.publish()
        self.shared.transfer.wait()  # this layer's copies and any prefetch into its slots
        if predicted is None:
            return _nothing
        # The host has just read this step's ids, so no kernel that read a slot the prefetch may
        # refill is still running: its copies wait for this point of the stream, not for the
        # kernel launched meanwhile.
        now = self.shared.transfer.record_main()
        return lambda: self.prefetch.start(predicted, after=now)

    def copy_in(self, copies: list[tuple[int, int]], after: torch.cuda.Event | None = None) -> None:
        """Copy (expert, slot) pairs from the host store into this layer's cache (after ``after``
        on the main stream, by default after everything issued there so far)."""
        if copies:
            job = self.copy_job(copies)
            self.cache.filling(job[1], self.shared.transfer.issue(*job, after=after))

    def copy_job(self, copies: list[tuple[int, int]]) -> tuple:
        """(dst, dst rows, src, src rows) of (expert, slot) copies, as ``Transfer.issue`` takes them."""
        experts, slots = zip(*copies)
        return self.cache.block, list(slots), self.store.block, self.store.rows(np.array(experts)).tolist()

    def _prefetch_next(self, predicted: np.ndarray | None) -> None:
        """Start copying the next layer's ``predicted`` experts (distinct, or None: no guess)."""
        if predicted is not None:
            self.prefetch.start(predicted)

    # ---- device side
    def _read_in_place(self, bank, x, weights, ids, shared=None) -> torch.Tensor:
        """Every expert read where it is, a slot or the host store, in one kernel call: nothing
        waits for the host (``host_reads.py``). Rows that only pad a graphed batch (KV slot -1)
        read the null slot (zeros, on the device) and count no use: their output is dropped."""
        real = real_rows(len(x), x.device)  # [T] bool
        route, route_down, join = routes(self)  # the down kernel's differs after a down-only prefetch
        rows = route_and_count(ids, real, route, self.map.null, self.uses)  # [T, k]
        down, host = None, self.store.tensors
        staging = self.reads.stage is not None and host_stage.stages(self.reads.fmt)
        self.host_staged = route_down is route and staging  # not beside a down-only prefetch
        if route_down is not route:
            down = (route_rows(ids, real, route_down, self.map.null), join)
        elif self.host_staged:  # host rows copied first
            rows, host = host_stage.stage(rows, self.store.block, self.reads.stage), self.reads.stage.tensors
        return bank.run(x, weights, rows, self.cache.tensors, shared, host=host, down=down)

    def lookahead(self, block, residual: torch.Tensor, norm) -> None:
        """Before the layer's mixer (``SparseMoeBlock.lookahead``). Streaming ahead: a long batch
        whose first groups the previous layer did not stage (the first MoE layer, or one after a
        layer that did not stream) stages them now, so the link streams through this layer's
        mixer and router as it does through the later layers'. With host reads' prefetch, route
        the guess ``norm(residual)`` through this layer's router and start copying the predicted
        host experts into the spare rows (``host_prefetch.py``)."""
        if streaming.streams_ahead(self, len(residual), block.gate.top_k):
            staged = self.shared.ahead
            # a decode batch is left to the previous layer: it may find its experts in the cache
            if not decode_only() and not capturing() and (staged is None or staged.backend is not self):
                streaming.stage_first_groups(self, None)
            return
        reads = self.reads
        if reads is None or self.spare is None or not host_prefetch.rows(reads.fmt):
            return
        if not reads.takes(block.experts, residual, decode_only()):
            return
        if self.first:
            reads.begin_forward()
        pred = block.gate(norm(residual))[1]
        host_prefetch.start(pred, real_rows(len(residual), residual.device), self)

    def _cached(
        self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared=None
    ) -> torch.Tensor:
        return bank.run(x, weights, self.cache.slot_ids(ids), self.cache.tensors, shared)  # on the slot rows

    def _cpu_share(self, bank, x, weights, route: HostRoute, host_only: np.ndarray):
        """Experts of a streamed batch that the host CPU computes instead (``hybrid.CpuShare``):
        none here (``host_only``: those the batch would copy from the host store)."""
        return None


def _nothing() -> None:
    pass
