"""The offload backend: a layer's experts in the host store, a GPU slot cache in front of them.

At start-up every dynamic slot is filled from the host store (``SlotMap.warm``), so the first
requests find the residency the plan reports instead of an empty cache.

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

Prefill (and any batch whose experts do not fit): the chunk's experts are streamed. Resident
ones, static ones included, are used in place (one kernel call on the slots), or, with
``--moe-prefill-hit-d2d``, copied device-to-device into staging with the rest; the others go
host -> staging in groups of B experts, through ``sizing.STAGING_BUFFERS`` buffers taken in turn
(groups g + 1 .. are copied while group g computes). A group runs the kernel on the pairs
(token, k) routed into it, k = 1 each, summed into an fp32 accumulator. Prefill never inserts
into the cache (a long prompt would flush the decode working set); its accesses still count for
the policy.

Streaming ahead (``--moe-stream-ahead``, on; ``--no-moe-stream-ahead`` turns it off): a batch with
at least ``AHEAD_PAIRS`` (token, k) pairs per expert routes to nearly every expert of every
layer, so the next layer's host-only experts are needed before its router says so. Once a layer
has queued its last group, the staging buffers are filled with the next layer's first groups
(``staging.AHEAD_GROUPS``, each once this layer's group before it in that buffer has been read; the
host-only experts it is predicted to use most: the prefetch router's picks, else the policy's use
counts), so the copy engine keeps streaming through that layer's attention or GDN
mixer and its router instead of idling until the router's ids reach the host. The first MoE
layer of a prefill, which no layer before it stages for, stages its own before its mixer
(``lookahead``). The next layer computes the staged experts that its routing hits and streams
the rest; an expert staged but not routed to costs its copy, never a result.

CUDA graphs: the host work sits behind ``split_point`` (``graph_split.py``), so a captured decode
step breaks at each MoE layer to make the batch's experts resident, then replays the kernel,
which reads the device table. The engine graphs only batch sizes whose experts are sure to fit
(``bs * k <= S``); larger decode batches run eagerly. Not here: which backend or how many slots
(``runtime``), the CPU computation of misses (``hybrid``), the staging buffers and what the layers
share (``staging``), the routing as the host reads it (``host_route``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import record_function

from ft.forward_context import get_forward_context
from ft.moe.backends import host_prefetch, host_stage, pairs
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.graph_split import capturing, split_point
from ft.moe.backends.host_prefetch import Spare, routes
from ft.moe.backends.host_reads import HostReads, route_and_count, route_rows
from ft.moe.backends.host_route import HostRoute, host_route
from ft.moe.backends.host_store import HostStore
from ft.moe.backends.pairs import Terms
from ft.moe.backends.prefetch import Prefetch
from ft.moe.backends.staging import Ahead, Prestaged, Shared
from ft.moe.backends.transfer import Transfer

try:  # a block's shared expert as one more GEMV pair (``triton_moe_gemv.SHARED_AS_PAIR``), on a GPU
    from ft.moe.kernels.triton_moe_gemv import shared_pair_alone
except ImportError:  # no triton: the block never asks for it
    shared_pair_alone = None

AHEAD_PAIRS = 3  # pairs per expert from which a batch stages the next layer's first groups early
# A layer whose first groups were staged ahead computes its first group before its hits in place,
# so the copy of the group after the staged ones (waiting for that buffer) overlaps the hits'
# compute: where the staged groups' copies have landed when the layer's MoE starts, the link
# otherwise idles through the hits (~4.4 ms a layer on the 16-layer cut's 8k prefill). On from
# 2026-12-03 (FT_MOE_HITS_AFTER_AHEAD=0 turns it off for a process and the ranks it spawns): that
# prefill on an H200, one machine, 413.4 -> 392.6 ms, the link busy 89 -> 98% of the profiled
# time; a third staging buffer beside it moved nothing more (395.9 ms; docs/benchmarks.md).
HITS_AFTER_AHEAD = os.environ.get("FT_MOE_HITS_AFTER_AHEAD", "1") != "0"


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

    # ---- entry
    def __call__(
        self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: tuple | None = None
    ) -> torch.Tensor:
        if self.reads is not None and self.reads.takes(bank, x, decode_only()):
            return self._read_in_place(bank, x, weights, ids, shared)
        ahead = self._take_ahead()
        pred = self._predict(x)
        if capturing():
            split_point(lambda: self._resolve(ids, pred))  # its prefetch runs after the next segment's launch
            return self._cached(bank, x, weights, ids, shared)
        route = self._route(ids, pred)
        experts = route.experts
        if decode_only() and self.map.fits(experts):
            prefetch = self._make_resident(experts, route.predicted_experts)
            out = self._cached(bank, x, weights, ids, shared)
            prefetch()
            return out
        with record_function("ft.offload.stream"):
            return self._stream(bank, x, weights, route, experts, ahead, shared)

    # ---- host side (eager, or at a graph break)
    def _predict(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.prefetch.predict(x) if self.prefetch is not None else None

    def _route(self, ids: torch.Tensor, pred: torch.Tensor | None) -> HostRoute:
        """The batch's routing on the host (the one synchronisation of the layer); the first MoE
        layer starts the step's slot pins."""
        with record_function("ft.offload.ids_to_host"):  # a range of profiles (profile_offload_prefill.py)
            route = host_route(ids, pred, self.store.num_experts)
        if self.first:
            self.shared.begin_step(len(ids))
        return route

    def _take_ahead(self) -> Ahead | None:
        """The group staged for this layer, if any; any other is dropped (a forward that stopped
        between the two layers: its buffer may be refilled before that layer runs again)."""
        ahead, self.shared.ahead = self.shared.ahead, None
        return ahead if ahead is not None and ahead.backend is self else None

    def _resolve(self, ids: torch.Tensor, pred: torch.Tensor | None) -> Callable[[], None]:
        route = self._route(ids, pred)
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
        if route_down is not route:
            down = (route_rows(ids, real, route_down, self.map.null), join)
        elif self.reads.stage is not None and host_stage.stages(self.reads.fmt):  # host rows copied first
            rows, host = host_stage.stage(rows, self.store.block, self.reads.stage), self.reads.stage.tensors
        return bank.run(x, weights, rows, self.cache.tensors, shared, host=host, down=down)

    def lookahead(self, block, residual: torch.Tensor, norm) -> None:
        """Before the layer's mixer (``SparseMoeBlock.lookahead``). Streaming ahead: a long batch
        whose first groups the previous layer did not stage (the first MoE layer, or one after a
        layer that did not stream) stages them now, so the link streams through this layer's
        mixer and router as it does through the later layers'. With host reads' prefetch, route
        the guess ``norm(residual)`` through this layer's router and start copying the predicted
        host experts into the spare rows (``host_prefetch.py``)."""
        if self._streams_ahead(len(residual), block.gate.top_k):
            staged = self.shared.ahead
            # a decode batch is left to the previous layer: it may find its experts in the cache
            if not decode_only() and not capturing() and (staged is None or staged.backend is not self):
                self.stage_first_groups(None)
            return
        reads = self.reads
        if reads is None or self.spare is None or not host_prefetch.rows(reads.fmt):
            return
        if not reads.takes(block.experts, residual, decode_only()):
            return
        if self.first:
            reads.begin_forward()
        pred = block.gate(norm(residual))[1]
        host_prefetch.start(pred, real_rows(len(residual), residual.device), self, reads.stream)

    def _cached(
        self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared=None
    ) -> torch.Tensor:
        return bank.run(x, weights, self.cache.slot_ids(ids), self.cache.tensors, shared)  # on the slot rows

    def _stream(
        self,
        bank,
        x,
        weights,
        route: HostRoute,
        experts: np.ndarray,
        ahead: Ahead | None,
        shared=None,
    ) -> torch.Tensor:
        sh, st = self.shared, self.shared.staging
        ids = route.ids  # [T, k] on the device
        hit = self.map.classify(experts)
        terms = Terms(x, weights.shape[1], shared is not None)  # [T, k (+ 1), H]
        early = np.isin(experts, ahead.experts) if ahead is not None else np.zeros(len(experts), dtype=bool)
        in_place = np.zeros_like(hit) if sh.hit_d2d else hit & ~early  # resident, used in their slots
        pre = sh.prestaged.pop(self, None)  # experts copied while the engine was idle
        from_pre = np.zeros_like(hit) if pre is None else ~early & ~in_place & np.isin(experts, pre.experts)
        staged = experts[~early & ~in_place & ~from_pre]
        on_cpu = self._cpu_share(bank, x, weights, route, staged[~self.map.resident(staged)])
        if on_cpu is not None:  # computed by the host CPU while the link streams the others
            staged = staged[~np.isin(staged, on_cpu.experts)]
        # prefetches into this layer's slots land before the hits are read: every copy issued
        # before the groups staged ahead (those are waited for group by group below)
        sh.transfer.wait(ahead.before if ahead is not None else None)
        groups = [staged[i : i + st.rows] for i in range(0, len(staged), st.rows)]
        ready = [None] * len(groups)  # (buffer, event) once staged: at most two at a time
        if ahead is not None:
            groups[:0], ready[:0] = ahead.groups, ahead.staged
            sh.ahead_used += len(ahead.groups)
        n = len(st.blocks)
        for g in range(min(n, len(groups))):  # in flight while the hits compute in place
            ready[g] = ready[g] or self._stage(groups[g])
        if on_cpu is not None:  # its rows to the host once the link is busy
            on_cpu.start(x, weights)
        # the pairs are grouped once the first copies are on their way (the link waits for nothing),
        # unless the CPU's share grouped them already
        resident = experts[in_place]
        calls = [(resident, self.map.slot_of[resident])] + [(g, np.arange(len(g))) for g in groups]
        if pre is not None:  # one more call, last: its rows in the pre-staged buffer
            used = experts[from_pre]
            calls.append((used, np.searchsorted(pre.experts, used)))
        if on_cpu is None and pairs.DEVICE_PAIRS:
            runs = pairs.device_runs(ids, weights, calls, route.counts)
        else:
            grouped = on_cpu.pairs if on_cpu is not None else pairs.Pairs(route.ids_h, self.store.num_experts)
            runs = pairs.upload_pairs([grouped.of(*call) for call in calls], weights)
        # the hits in place first, unless a group staged ahead can go first: its kernel frees a
        # buffer, so the next group streams while the hits compute (the order is fixed by whether
        # groups were staged ahead, not by timing: the same sums every run)
        hits_later = HITS_AFTER_AHEAD and ahead is not None and len(ahead.groups) > 0
        if not hits_later:  # what is on the device already, while the groups stream
            self._run_in_place(bank, x, terms, runs, pre)
        for g in range(len(groups)):
            buf, event = ready[g]
            sh.transfer.wait(event)
            terms.run(bank, st.tensors[buf], x, *runs[g + 1])
            st.free_after[buf] = sh.transfer.record_main()
            if g + n < len(groups):  # into the buffer group g has just been read from
                ready[g + n] = self._stage(groups[g + n])
            if g == 0 and hits_later:  # group 0 has freed its buffer for the next group's copy
                self._run_in_place(bank, x, terms, runs, pre)
        # its term, as the fused call adds it after the routed ones (issued now, added last)
        shared_term = shared_pair_alone(x, shared) if shared is not None else None
        self._prefetch_next(route.predicted_experts)  # before staging ahead: the next layer waits for it
        if self.next is not None and self._streams_ahead(len(x), weights.shape[1]):
            self.next.stage_first_groups(route.predicted)
        if on_cpu is not None:  # the host computes its share while the GPU runs what it was given
            on_cpu.add_to(bank, self.store, terms)
        return terms.total(shared_term)

    def _run_in_place(self, bank, x, terms: Terms, runs, pre: Prestaged | None) -> None:
        """The pairs of experts already on the device: those pre-staged while the engine was idle
        (``runs[-1]``, once their copies have landed), then the hits in their slots (``runs[0]``)."""
        if pre is not None:
            self.shared.transfer.wait(pre.ready)
            terms.run(bank, pre.tensors, x, *runs[-1])
            self.shared.prestage_used += len(runs[-1][0]) > 0
        terms.run(bank, self.cache.tensors, x, *runs[0])

    def _cpu_share(self, bank, x, weights, route: HostRoute, host_only: np.ndarray):
        """Experts of a streamed batch that the host CPU computes instead (``hybrid.CpuShare``):
        none here (``host_only``: those the batch would copy from the host store)."""
        return None

    def _streams_ahead(self, tokens: int, top_k: int) -> bool:
        """Whether a batch of ``tokens`` stages layers' first groups ahead of their routers
        (``--moe-stream-ahead``): at least ``AHEAD_PAIRS`` (token, k) pairs per expert, so it
        routes to nearly every expert of every layer."""
        sh = self.shared
        return (
            sh.stream_ahead
            and sh.staging is not None
            and tokens * top_k >= AHEAD_PAIRS * self.store.num_experts
        )

    def _prestageable(self) -> np.ndarray:
        """The host-only experts this layer could pre-stage now (none when it holds some already)."""
        if self.map is None or self in self.shared.prestaged:
            return np.empty(0, dtype=np.int64)
        return self.map.absent()

    def prestage_capacity(self) -> int:
        return len(self._prestageable())

    def prestage(self, max_rows: int) -> None:
        """Copy up to ``max_rows`` of this layer's host-only experts, those its policy ranks first,
        into a buffer of their own (``staging.PRESTAGE``; ``prestage_capacity`` says how many it could)."""
        host_only = self._prestageable() if max_rows > 0 else []
        if len(host_only) == 0:
            return
        ranked = host_only[np.argsort(-self.map.freq[host_only], kind="stable")][:max_rows]
        experts = np.sort(ranked)
        layout, sh = self.store.layout, self.shared
        block = layout.allocate(len(experts), self.cache.block.device, zero=False)
        if sh.prestage_transfer is None:
            sh.prestage_transfer = Transfer(sh.transfer.device)
            sh.prestage_transfer.counts = sh.transfer.counts
        ready = sh.prestage_transfer.issue(
            block, list(range(len(experts))), self.store.block, self.store.rows(experts).tolist()
        )
        if block.is_cuda:  # freed however (consumed, dropped, the engine closed), reused only once copied
            block.record_stream(sh.prestage_transfer.stream)
        self.shared.prestaged[self] = Prestaged(experts, block, layout.views(block), ready)

    def stage_first_groups(self, predicted: np.ndarray | None) -> None:
        """Stage this layer's likeliest host-only experts into ``Staging.ahead`` groups before its
        router runs (``predicted``: the prefetch router's picks for it per expert, else the policy's
        use counts rank them). Called by the previous layer once it has queued its last group: each goes
        into the next buffer in turn, its copy waiting for that layer's kernel that reads the
        buffer before it, so that the buffers stream through this layer's mixer and router; or by
        this layer's lookahead, before its mixer."""
        host_only = self.map.absent() if self.map is not None else []
        pre = self.shared.prestaged.get(self)
        if pre is not None:  # those are on the device already
            host_only = host_only[~np.isin(host_only, pre.experts)]
        if len(host_only) == 0:
            return
        freq = self.map.freq
        use = freq if predicted is None else predicted
        rows, ahead = self.shared.staging.rows, self.shared.staging.ahead
        ranked = host_only[np.argsort(-use[host_only], kind="stable")][: ahead * rows]
        groups = [np.sort(ranked[i : i + rows]) for i in range(0, len(ranked), rows)]
        before = self.shared.transfer.record_copies()  # what this layer waits for at its start
        self.shared.ahead = Ahead(self, groups, [self._stage(group) for group in groups], before)

    def _stage(self, group: np.ndarray) -> tuple[int, torch.cuda.Event | None]:
        """Copy a group of experts into the next staging buffer; returns the buffer and the event
        its reader waits on. Resident experts go device-to-device (``hit_d2d``), the others from
        the host store."""
        st, tr = self.shared.staging, self.shared.transfer
        buf, self.shared.next_buf = self.shared.next_buf, (self.shared.next_buf + 1) % len(st.blocks)
        rows = np.arange(len(group))
        on_device = self.map.resident(group)
        after = st.free_after[buf]
        ev_d2d = tr.issue(
            st.blocks[buf], rows[on_device].tolist(), self.cache.block,
            self.map.slot_of[group[on_device]].tolist(), after=after, h2d=False,
        )  # fmt: skip
        ev_h2d = tr.issue(
            st.blocks[buf],
            rows[~on_device].tolist(),
            self.store.block,
            self.store.rows(group[~on_device]).tolist(),
            after=after,
        )
        return buf, (ev_h2d if ev_h2d is not None else ev_d2d)  # one stream: the later covers both


def _nothing() -> None:
    pass
