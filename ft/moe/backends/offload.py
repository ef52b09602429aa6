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
(``AHEAD_GROUPS``, each once this layer's group before it in that buffer has been read; the
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
(``runtime``), the CPU computation of misses (``hybrid``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import record_function

from ft.forward_context import get_forward_context
from ft.moe.backends import host_prefetch, host_stage, pairs
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.graph_split import capturing, split_point
from ft.moe.backends.host_prefetch import Spare, routes
from ft.moe.backends.host_reads import HostReads, route_and_count, route_rows
from ft.moe.backends.host_store import HostStore
from ft.moe.backends.layout import ExpertLayout
from ft.moe.backends.pairs import Terms
from ft.moe.backends.prefetch import Prefetch
from ft.moe.backends.transfer import Transfer

try:  # a block's shared expert as one more GEMV pair (``triton_moe_gemv.SHARED_AS_PAIR``), on a GPU
    from ft.moe.kernels.triton_moe_gemv import shared_pair_alone
except ImportError:  # no triton: the block never asks for it
    shared_pair_alone = None

AHEAD_PAIRS = 3  # pairs per expert from which a batch stages the next layer's first groups early
# groups staged ahead, at most one a staging buffer (0: one in each): 1 gained 2% on the 8k prefill
# (554 -> 542 ms, 16 layers, one H200, 2026-12-01); 1 and 2 on that cut 438 / 437 ms, link busy
# 84% / 85% (2026-12-02, no same-day row without); 2 with the first layer's own staging on the
# full 80B bf16 at --memory-ratio 0.94: 8k prefill 9,114 -> 10,990 tok/s (61 -> 74% of the link)
AHEAD_GROUPS = max(0, int(os.environ.get("FT_MOE_AHEAD_GROUPS", "0")))
# A layer whose first groups were staged ahead computes its first group before its hits in place,
# so the copy of the group after the staged ones (waiting for that buffer) overlaps the hits'
# compute: where the staged groups' copies have landed when the layer's MoE starts, the link
# otherwise idles through the hits (~4.4 ms a layer on the 16-layer cut's 8k prefill). On from
# 2026-12-03 (FT_MOE_HITS_AFTER_AHEAD=0 turns it off for a process and the ranks it spawns): that
# prefill on an H200, one machine, 413.4 -> 392.6 ms, the link busy 89 -> 98% of the profiled
# time; a third staging buffer beside it moved nothing more (395.9 ms; docs/benchmarks.md).
HITS_AFTER_AHEAD = os.environ.get("FT_MOE_HITS_AFTER_AHEAD", "1") != "0"
# Pre-staging: when the engine falls idle (``MoeRuntime.idle``), MoE layers' host-only experts, the
# policy's likeliest first, are copied into buffers of their own, on a stream of their own, in what
# the plan leaves an idle engine (``MoeRuntime._room_when_idle``, kept as ``Shared.prestage_room``),
# shared out evenly over the layers (``prestage_rows``), so that the next prefill computes them
# where they are and every layer streams only the rest. A 1k prompt touches every expert of every
# layer, and the full 80B's TTFT (561 ms on an H200, 2026-12-03) is the link's 0.54 s for its
# misses; a request that finds the engine idle would skip the pre-staged experts' share of it.
# Before a forward, layers are dropped, the last first, until the batch's activations fit beside the
# rest (``Shared.fit_prestaged``); a pre-staged expert the batch does not route to costs its copy,
# never a result. The hook is ``LLMEngine.idle``: the serving loop calls it once a step's outputs
# are out and no request is left, ``LLM.generate`` before it returns, ``ft bench offline
# --ttft-idle-s`` before each TTFT run. ON from 2026-12-03 (FT_MOE_PRESTAGE=0 turns it off for a
# process and the ranks it spawns): the full 80B bf16 at 0.94 on an H200, ~5.7 GiB staged, TTFT of a
# 1k prompt after 1 s idle 558 -> 448 ms (docs/benchmarks.md). The first layers in full instead
# saved only ~60 ms (497 ms): the link idled while they computed from their buffers, only the next
# layer's first groups streaming ahead. Before, with the hook inside the step that finished the last
# request and the alignment kernels compiled for each new buffer size, it was a loss (569 -> 973
# ms).
PRESTAGE = os.environ.get("FT_MOE_PRESTAGE", "1") != "0"
PRESTAGE_CPU_BYTES = 1 << 30  # the room on a CPU-only machine, where no plan measures one
# of the room an idle GPU has, kept for the next batch's small tensors and for what the CUDA graphs'
# private pools reserve beyond their live tensors (no other allocation can use it)
PRESTAGE_MARGIN = 1 << 30
# (token, k) pairs from which a batch's experts are counted on the device (``HostRoute``);
# FT_MOE_DEVICE_COUNTS_MIN_PAIRS sets it for a process and the ranks it spawns (a number above any
# batch's pairs turns the device's count off)
DEVICE_COUNTS_MIN_PAIRS = int(os.environ.get("FT_MOE_DEVICE_COUNTS_MIN_PAIRS", "8192"))


@dataclass
class HostRoute:
    """What the host reads of a layer's routing at the layer's one synchronisation: per expert,
    the batch's (token, k) pairs (``counts``) and the prefetch router's picks (``predicted``;
    None without prefetch). A batch of at least ``DEVICE_COUNTS_MIN_PAIRS`` pairs counts them on
    the device and copies 2E counts instead of its [T, k] ids and the guess's: at 16k tokens
    those are 2.6 MB a layer into pageable memory and then passes over every pair on the host,
    and on an H200 (the 16-layer cut's 16k chunk, 2026-12-03, docs/benchmarks.md) the GPU sat
    idle ~2.3 ms a layer between the router and the first kernel the host issued after reading
    them, the link ~5.9 ms in the worst gap. Its ``ids_h`` is copied only for a path that still
    groups pairs on the host (``pairs.DEVICE_PAIRS`` off, the hybrid backend's CPU share). The
    same experts, counts and guesses either way; NOT yet timed on a GPU."""

    counts: np.ndarray  # [E] int64
    predicted: np.ndarray | None  # [E] int64
    ids: torch.Tensor  # [T, k] on the device
    copied: np.ndarray | None = None  # the ids on the host, once copied

    @property
    def experts(self) -> np.ndarray:
        """The batch's distinct experts, ascending."""
        return np.flatnonzero(self.counts)

    @property
    def predicted_experts(self) -> np.ndarray | None:
        return None if self.predicted is None else np.flatnonzero(self.predicted)

    @property
    def ids_h(self) -> np.ndarray:
        if self.copied is None:
            self.copied = self.ids.cpu().numpy()
        return self.copied


def host_route(ids: torch.Tensor, pred: torch.Tensor | None, num_experts: int) -> HostRoute:
    """``ids`` [T, k] (and ``pred``, the guess) read by the host: the layer's synchronisation."""
    e, k = num_experts, ids.shape[1]
    if ids.numel() < DEVICE_COUNTS_MIN_PAIRS:
        both = ids if pred is None else torch.cat([ids, pred], dim=1)
        h = both.cpu().numpy()
        guess = None if pred is None else np.bincount(h[:, k:].reshape(-1), minlength=e)
        return HostRoute(np.bincount(h[:, :k].reshape(-1), minlength=e), guess, ids, h[:, :k])
    flat = ids.reshape(-1) if pred is None else torch.cat([ids.reshape(-1), pred.reshape(-1) + e])
    flat = flat.long()
    counts = torch.zeros(2 * e if pred is not None else e, dtype=torch.int64, device=ids.device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat)).cpu().numpy()  # (bincount syncs twice more)
    return HostRoute(counts[:e], None if pred is None else counts[e:], ids)


class Staging:
    """``buffers`` device buffers of ``rows`` expert rows, shared by the layers of a rank (one runs
    at a time) and taken in turn; ``free_after[b]``: the event after the last kernel that read
    buffer b."""

    def __init__(self, layout: ExpertLayout, rows: int, device: torch.device, buffers: int = 2) -> None:
        self.rows = rows
        self.blocks = [layout.allocate(rows, device, zero=False) for _ in range(buffers)]
        self.tensors = [layout.views(b) for b in self.blocks]
        self.free_after: list[torch.cuda.Event | None] = [None] * buffers

    @property
    def ahead(self) -> int:
        """Groups a layer stages for the next before its router runs (``AHEAD_GROUPS``)."""
        return min(len(self.blocks), AHEAD_GROUPS or len(self.blocks))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)


@dataclass
class Ahead:
    """The first groups staged for ``backend`` before its router ran, each with its buffer and the
    event its reader waits on."""

    backend: OffloadBackend
    groups: list[np.ndarray]
    staged: list[tuple[int, torch.cuda.Event | None]]
    before: torch.cuda.Event | None  # the copy stream just before them: the copies issued earlier

    @property
    def experts(self) -> np.ndarray:
        return np.concatenate(self.groups)


@dataclass
class Prestaged:
    """A layer's host-only ``experts`` (ascending) copied into a buffer of their own while the
    engine was idle (``OffloadBackend.prestage``); ``ready``: the event its readers wait on."""

    experts: np.ndarray
    block: torch.Tensor
    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None

    @property
    def nbytes(self) -> int:
        return self.block.numel()


@dataclass
class Shared:
    """What the offloading layers of one rank share: the copy engine, staging, the step count."""

    transfer: Transfer
    staging: Staging | None
    hit_d2d: bool
    maps: list  # every layer's SlotMap, to start a step on all of them at once
    stream_ahead: bool = False  # --moe-stream-ahead
    next_buf: int = 0  # the staging buffer the next group goes to (taken in turn)
    ahead: Ahead | None = None  # the next layer's first group, staged early
    ahead_used: int = 0  # groups staged ahead and then computed (tests read it)
    step: int = 0
    tokens: int = 0  # tokens through the first MoE layer (for bytes per token)
    cpu_pairs: int = 0  # (token, expert) pairs computed on the CPU (hybrid, cpu)
    prestaged: dict = field(default_factory=dict)  # backend -> Prestaged, in layer order
    # pre-staging's copies on a stream of their own (the same counts): a layer that waits for
    # every copy issued before it (prefetches into its slots) does not wait for later layers'
    prestage_transfer: Transfer | None = None
    prestage_room: int = 0  # bytes pre-staged layers and a batch's activations share (set when idle)
    activation_per_token: int = 0  # a batch's activations a token (``sizing.activation_bytes_per_token``)
    prestage_used: int = 0  # pre-staged layers a batch then computed (tests read it)

    def begin_step(self, num_tokens: int) -> None:
        """A forward of ``num_tokens`` tokens starts: every layer's slot map pins for a new step."""
        self.step += 1
        self.tokens += num_tokens
        for m in self.maps:
            m.begin_step(self.step)

    def fit_prestaged(self, num_tokens: int) -> None:
        """Keep the pre-staged layers, the first ones first, that leave a batch of ``num_tokens``
        room for its activations; drop the others (their buffers go back to the allocator, which
        hands them out again once their copies have landed: ``OffloadBackend.prestage``)."""
        room, kept = self.prestage_room - num_tokens * self.activation_per_token, 0
        for backend, staged in list(self.prestaged.items()):
            if kept + staged.nbytes <= room:
                kept += staged.nbytes
                continue
            del self.prestaged[backend]


def prestage_rows(room_rows: int, capacity: list[int]) -> list[int]:
    """Rows each layer pre-stages from ``room_rows`` in all, at most ``capacity[i]`` in layer i, as
    evenly as the capacities allow: a layer that cannot take its share leaves it to the others,
    and what does not divide evenly goes to the first layers."""
    rows, left = [0] * len(capacity), max(0, room_rows)
    open_ = [i for i, cap in enumerate(capacity) if cap > 0]
    while left > 0 and open_:
        share = max(1, left // len(open_))
        for i in list(open_):
            take = min(share, capacity[i] - rows[i], left)
            rows[i] += take
            left -= take
            if rows[i] == capacity[i]:
                open_.remove(i)
            if left == 0:
                break
    return rows


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
        into a buffer of their own (``PRESTAGE``; ``prestage_capacity`` says how many it could)."""
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
