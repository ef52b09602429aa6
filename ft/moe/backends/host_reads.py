"""Host reads: decode batches whose MoE kernels read missed experts from the host store themselves.

The offload backend's own decode makes a layer's experts resident before its kernel runs: the
host reads the routing ids (a synchronisation per MoE layer), copies the misses into slots and
writes the slot table, so a graphed decode step breaks at every MoE layer (``graph_split``).
With host reads, a decode batch that the bank hands its MoE GEMV runs that kernel on the slots
*and* the host store at once: ``cache.route[e]`` is e's slot, or -(row + 1) for an expert whose
rows the kernel then reads from the pinned host store over PCIe, through unified addressing (an
H200 read random 6 MB blocks at 51 GB/s this way, against 55 GB/s for a DMA copy:
tests/gpu/zero_copy_bandwidth.py). Nothing in the step waits for the host, so the whole step is
one CUDA graph, and the result is bit for bit the other paths': the same bytes are read.

What the cache holds changes between steps. Each layer counts its experts' uses on the device
(``uses`` [L, E]); ``after_step`` reads the counts (one small copy), counts hits and misses for
the policy and the statistics, and promotes some missed experts into slots. A miss costs no copy
here, so copying every miss into the cache (what the default path does) would send the missed
bytes over PCIe twice: a layer promotes ``PROMOTE_SHARE`` of its misses (credited across steps),
victims by the policy, which lets the cache follow skewed routing at a bounded cost. The copies
wait for every kernel issued before them (the victims' last readers); the route written next, on
the main stream before the next step, sends the victims to the host, and a newcomer too until
its slot's last copy has landed (``ExpertCache.copying``). Every step ends with each layer's
route following its map, so what a copying step changed (its prefetches) is routed right.

On (``ENABLED``; ``FT_MOE_HOST_READS=0`` turns it off, the switch read at each call, and the
state set up for every offload engine whose host store a kernel can read): on an H200,
2026-12-01, batch-1 decode of Qwen3-Next cut to 16 layers with 61% of the experts resident
went 97.3 -> 112.0 tok/s (118 in a second row) with the same greedy tokens, and the full
80B, 77% resident, 36.2 -> 45.0 (uniform routing) and 65.5 -> 85.4 (Zipf) against the copying
path's figures of 2026-11-30 (docs/benchmarks.md). Not here: prefill and decode
batches the GEMV does not take (the offload paths stream or copy them), the hybrid and cpu
backends (they compute misses on the CPU). Rows that only pad a graphed batch to its graph size
read the null slot and count no use.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ft.moe.backends import host_prefetch, host_stage
from ft.moe.backends.expert_cache import Tables
from ft.quant.nvfp4 import NVFP4Tensor

ENABLED = os.environ.get("FT_MOE_HOST_READS", "1") != "0"
PROMOTE_SHARE = 1 / 16  # of a layer's misses, promoted into its cache between steps
CPU_MAX_TOKENS = 4  # without a GPU (tests), decode batches up to this size take host reads
# On a GPU, the largest decode batch host reads take, by bank format (and only batches the bank's
# MoE GEMV takes). bf16: 4, the GEMV limit it was timed with. NVFP4: 8, with its host experts staged
# (``host_stage.py``: an expert two tokens share crosses PCIe once): on an H200 (2026-12-03 23:55
# UTC, the NVFP4 80B under 48 GiB, batch 8) 165.1 tok/s decode taking the copying path (host reads
# up to 2) against 226.9 with staged host reads up to 8 (68% -> 85% of the PCIe floor); 9 to 16
# tokens untimed. FT_MOE_HOST_READS_NVFP4_MAX_TOKENS=N sets NVFP4's for a process.
MAX_TOKENS = {"bf16": 4, "nvfp4": int(os.environ.get("FT_MOE_HOST_READS_NVFP4_MAX_TOKENS", "8"))}
# The between-step work a step late (``DEFERRED``; FT_MOE_HOST_READS_DEFERRED=0 turns it off):
# ``after_step`` queues the step's counts to pinned host memory, with the routes it read, and
# processes the step before's, which the GPU has finished by then, so the host's counting and
# promotions run while the GPU computes the step just launched instead of before it. On an H200
# (2026-12-01) that work took 2.9 ms a step for 16 layers (``_count_and_promote`` 1.7 ms with its
# copies, ``publish`` 0.5 ms), and the 16-layer cut at 61% residency went 102.8 -> 124.1 tok/s
# at batch 1, same greedy tokens. A step is counted as it read its experts, even if promotions
# moved them since; promotions take effect a step later; ``flush`` (statistics) counts the step
# still queued.
DEFERRED = os.environ.get("FT_MOE_HOST_READS_DEFERRED", "1") != "0"
# A host-read layer's rows and use counts in one kernel (``route_and_count``) instead of five
# (the use of each pair as int32, expanded, added into ``uses``; the route gathered, the padding
# sent to the null slot): 4 launches fewer a layer, ~190 a step of the 48-layer model. Off until
# a GPU run times it (FT_MOE_HOST_READS_FUSED_ROUTE=1); the switch is read at each call.
FUSED_ROUTE = os.environ.get("FT_MOE_HOST_READS_FUSED_ROUTE", "0") == "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machine: the torch version of ``route_and_count``
    triton = None


class HostReads:
    """The host-read state of one rank: every offloading layer's use counts and promotions."""

    def __init__(
        self, backends: list, top_k: int, device: torch.device, fmt: str | None = None, stage_tokens: int = 0
    ) -> None:
        self.backends, self.top_k = backends, top_k
        self.fmt = fmt  # the banks' format (what their prefetch does: ``host_prefetch.rows``)
        # with ``host_stage.STAGE`` (``stage_tokens`` > 0: the largest batch host reads take): the
        # device rows a layer's host experts are copied into, one a pair
        self.stage = None
        if stage_tokens > 0:
            self.stage = host_stage.StageBlock(backends[0].store.layout, stage_tokens * top_k, device)
        e = self.num_experts = backends[0].store.num_experts
        spare = backends[0].cache.spare  # rows a layer's prefetch fills (``host_prefetch.py``)
        # [L, E + spare]: each layer's uses of its experts, then the experts its prefetch picked
        self.uses = torch.zeros(len(backends), e + spare, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.host_uses = torch.zeros(len(backends), e + spare, dtype=torch.int32, pin_memory=pin)  # DEFERRED
        self.stream = torch.cuda.Stream(device) if spare and device.type == "cuda" else None  # its copies
        self.queued: tuple | None = None  # (event, the routes its step read, staged): DEFERRED
        self.credit = np.zeros(len(backends))  # promotions owed to each layer, fractional
        self.bytes_read = 0  # expert bytes kernels read from the host store
        self.taken = False  # a batch took host reads (eagerly or while a graph was captured)
        self.tables = Tables([b.cache for b in backends], device)  # every layer's, one copy to publish
        self.payload = np.array([b.store.layout.payload_bytes for b in backends], dtype=np.int64)
        self.payload_down = np.array(  # what a down-only prefetch copies of an expert
            [host_prefetch.down_payload(b.store.layout) for b in backends], dtype=np.int64
        )
        for i, b in enumerate(backends):
            b.reads, b.uses = self, self.uses[i]
            b.spare = host_prefetch.Spare(b.cache, self.uses[i, e:]) if spare else None

    def takes(self, bank, x: torch.Tensor, decode: bool) -> bool:
        """Whether a batch reads its experts where they are: the switch on (read at each call, so
        a benchmark can compare both paths on one loaded model, capturing the graphs again),
        decode, and a size the GEMV takes."""
        if not ENABLED or not decode:
            return False
        takes = self.takes_tokens(bank, len(x), x.is_cuda)
        self.taken |= takes
        return takes

    @staticmethod
    def takes_tokens(bank, tokens: int, cuda: bool) -> bool:
        """Whether host reads take a decode batch of ``tokens`` tokens: one the bank's GEMV takes
        up to the format's ``MAX_TOKENS`` (on a GPU), or small enough (without one)."""
        if not cuda:
            return 0 < tokens <= CPU_MAX_TOKENS
        return bank.takes_gemv(tokens) and tokens <= MAX_TOKENS.get(bank.format, 0)

    @staticmethod
    def max_tokens(bank, cuda: bool, limit: int = 256) -> int:
        """The largest decode batch (up to ``limit``) that host reads take for ``bank``; 0: none."""
        return max((t for t in range(1, limit + 1) if HostReads.takes_tokens(bank, t, cuda)), default=0)

    def discard(self) -> None:
        """Forget the uses counted so far (the warm-up and capture of the decode graphs), and any
        prefetch a forward started and did not read (its route would outlive the next publish)."""
        self.uses.zero_()
        self.queued = None
        self.begin_forward()

    def begin_forward(self) -> None:
        """A forward's first host-read layer: no prefetch of an earlier forward is still to be
        read (one that stopped between two layers would route through spare rows a publish has
        since made stale)."""
        for b in self.backends:
            if b.spare is not None:
                b.spare.pending = False

    def before_step(self) -> None:
        """Before a step host reads may take (``MoeRuntime.before_step`` asks): every layer's route
        follows its map, whatever the steps before did to it (promotions, a copying step's
        prefetches, landed copies). A batch they do not take (prefill, a copying decode batch)
        routes by each layer's own table, which its copying path publishes mid-step, so it
        skips the upload of every layer's tables: 1.3-1.4 ms of host time a step, between
        two steps, at batch 8 on the full 80B (an H200, 2026-12-03). A padded graph batch is
        never smaller than its tokens, so a batch that pads into host reads publishes too."""
        self.tables.publish()

    def after_step(self) -> None:
        """Between steps: count what the last step's host-read layers used and promote some misses
        (published before the next step that reads them, ``before_step``)."""
        if self.taken and DEFERRED:
            self._queue()
        elif self.taken:  # else nothing was counted: the offload backend's own paths ran
            self.queued = None  # a step DEFERRED left: its counts are dropped, not double-counted
            uses = self.uses.to("cpu", copy=True).numpy()  # [L, E]; waits for the step
            if uses.any():
                self.uses.zero_()
                self._count_and_promote(uses, [b.cache.published() for b in self.backends], self._staged())

    def flush(self) -> None:
        """Count and promote the step ``DEFERRED`` still holds (waits for it), then publish: the
        statistics then include every step run so far."""
        if self.queued is None:
            return
        self._process_queued()
        self.tables.publish()

    def _process_queued(self) -> None:
        event, routes, staged = self.queued
        self.queued = None
        if event is not None:
            event.synchronize()
        uses = self.host_uses.numpy()
        if uses.any():
            self._count_and_promote(uses, routes, staged)

    def _queue(self) -> None:
        """Process the step before's counts (done on the GPU by now: the host has since launched
        this step), then send this step's on their way, with the routes it read."""
        routes = [b.cache.published() for b in self.backends]  # what this step read; a publish
        # replaces these arrays, never changes them
        staged = self._staged()
        if self.queued is not None:
            self._process_queued()
        self.host_uses.copy_(self.uses, non_blocking=True)
        self.uses.zero_()  # after the copy, on the same stream
        event = None
        if self.uses.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.queued = (event, routes, staged)

    def _staged(self) -> np.ndarray:
        """[L] bool: whether each layer's host-read call copies its host experts into the staging
        block first (``host_stage``; the decision of its last call, which a captured graph keeps)."""
        return np.array([b.host_staged for b in self.backends])

    def _count_and_promote(
        self, uses: np.ndarray, routes: list[np.ndarray], staged: np.ndarray | None = None
    ) -> None:
        """``uses`` [L, E + spare] of a host-read step (each layer's uses of its experts, then its
        prefetch's picks), which read ``routes`` (each layer's [E]); ``staged`` [L]: the layers
        that staged their host experts (None: none did). Its tokens were counted as it ran
        (``MoeRuntime.after_step``)."""
        e = self.num_experts
        counts = uses[:, :e]
        assert counts.any(1).all(), "a host-read step reads in every MoE layer (one batch, one path)"
        sh = self.backends[0].shared
        sh.begin_step()
        # every layer's hits and misses as the step read them, whatever moved since
        used, hit = self.tables.maps.classify_step(counts, np.stack(routes))
        missed = used & ~hit
        read = missed  # misses the kernels read from the host store
        picks = uses[:, e:]  # [L, spare] expert + 1: prefetched, copied once, read on the device
        if picks.any():
            picked = np.zeros((len(uses), e + 1), dtype=bool)
            picked[np.arange(len(uses))[:, None], picks] = True
            picked = picked[:, 1:]
            copies = picked.sum(1)
            down_only = host_prefetch.down_only(self.fmt)  # what the copies moved (the switch as it is now)
            self.bytes_read += int(copies @ (self.payload_down if down_only else self.payload))
            for b, n, h in zip(self.backends, copies.tolist(), (missed & picked).sum(1).tolist()):
                b.map.counts.prefetched += n
                b.map.counts.prefetch_hits += h
            read = missed & ~picked
            if down_only:  # a used pick's gate/up rows were still read from the host
                used_picks = np.where(missed & picked, counts, 0).sum(1)
                self.bytes_read += int(used_picks @ (self.payload - self.payload_down))
        # read in place, every pair reads its expert's rows; staged, each host expert's row crosses
        # the link once, however many pairs then read it (``host_stage.plan``)
        per_layer = np.where(read, counts, 0).sum(1)
        if staged is not None:
            per_layer = np.where(staged, read.sum(1), per_layer)
        self.bytes_read += int(per_layer @ self.payload)
        self.credit += PROMOTE_SHARE * missed.sum(1)
        owed = self.credit.astype(np.int64)  # whole promotions (credit >= 0: a floor)
        self.credit -= owed
        jobs, filled = [], []
        for i in np.flatnonzero(owed).tolist():
            b = self.backends[i]
            copies = b.map.promote(np.flatnonzero(missed[i]), int(owed[i]))
            if copies:
                jobs.append(b.copy_job(copies))
                filled.append((b.cache, jobs[-1][1]))
        # one issue for every layer's copies; they wait for every kernel issued so far (the
        # victims' last readers); the route published next sends the victims, and the newcomers
        # until their copies land, to the host
        done = sh.transfer.issue_many(jobs)
        for cache, slots in filled:
            cache.filling(slots, done)


def route_and_count(
    ids: torch.Tensor, real: torch.Tensor, route: torch.Tensor, null: int, uses: torch.Tensor
) -> torch.Tensor:
    """A host-read layer's kernel rows [T, k] for its routing ``ids`` [T, k]: ``route[ids]`` (a
    slot, or -(host row + 1)) for the real rows of the batch (``real`` [T] bool), the null slot
    for rows that pad it; adds each real pair's use into ``uses`` [E + spare] int32. One kernel
    on a GPU with ``FUSED_ROUTE``, else torch's operators."""
    assert ids.dim() == 2 and real.shape == ids.shape[:1] and real.dtype == torch.bool, (
        f"ids [T, k] and real [T] bool, got {tuple(ids.shape)} and {tuple(real.shape)} {real.dtype}"
    )
    assert uses.dim() == 1 and uses.dtype == torch.int32 and uses.is_contiguous(), (
        f"uses must be a contiguous int32 row, got {uses.dtype} {tuple(uses.shape)}"
    )
    if FUSED_ROUTE and ids.is_cuda and triton is not None:
        pairs = ids.numel()
        rows = torch.empty(ids.shape, dtype=route.dtype, device=ids.device)
        _route_and_count_kernel[(1,)](
            ids.contiguous(), real, route, rows, uses, null, pairs,
            K=ids.shape[1], BLOCK=max(16, triton.next_power_of_2(pairs)),
        )  # fmt: skip
        return rows
    count = real.to(torch.int32)[:, None].expand(ids.shape).reshape(-1)  # a use per real pair
    uses.index_add_(0, ids.reshape(-1), count)
    return route_rows(ids, real, route, null)


def route_rows(ids: torch.Tensor, real: torch.Tensor, route: torch.Tensor, null: int) -> torch.Tensor:
    """``route[ids]`` for the real rows of the batch, the null slot for rows that pad it (what
    ``route_and_count`` returns, without counting: a down kernel's own route)."""
    return torch.where(real[:, None], route[ids], null)


if triton is not None:

    @triton.jit
    def _route_and_count_kernel(
        ids, real, route, rows, uses, null, PAIRS, K: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        p = tl.arange(0, BLOCK)
        in_p = p < PAIRS
        e = tl.load(ids + p, mask=in_p, other=0)
        is_real = tl.load(real + p // K, mask=in_p, other=0) != 0
        slot = tl.load(route + e, mask=in_p, other=0)
        tl.store(rows + p, tl.where(is_real, slot, null).to(rows.dtype.element_ty), mask=in_p)
        tl.atomic_add(uses + e, tl.full([BLOCK], 1, tl.int32), mask=in_p & is_real)


def as_one_bank(slots: tuple, host: tuple, ids: torch.Tensor, down_ids: torch.Tensor | None = None) -> tuple:
    """(w13, w2, ids) of one bank holding the slots, then the host store's rows, with the host
    rows' ids (e < 0: row -e - 1) moved past the slots: what host reads compute, for kernels that
    cannot read host memory from a device (the CPU reference, in tests). With ``down_ids`` (the
    down kernel's rows, ids as ``ids``; one per expert, as a route gives them) each row that
    ``ids`` reads takes its down projection from the row ``down_ids`` names."""
    n = _rows(slots[0])
    w13, w2 = (_cat(s, h) for s, h in zip(slots, host))
    ids = torch.where(ids >= 0, ids, n - 1 - ids)
    if down_ids is not None:
        down = torch.where(down_ids >= 0, down_ids, n - 1 - down_ids)
        w2 = _moved(w2, ids.reshape(-1), down.reshape(-1))
    return w13, w2, ids


def _moved(w, dst: torch.Tensor, src: torch.Tensor):
    """``w`` with rows ``dst`` replaced by rows ``src`` (each dst row given one src row)."""
    if isinstance(w, NVFP4Tensor):
        return NVFP4Tensor(*(_moved(p, dst, src) for p in w.parts))
    out = w.clone()
    out[dst] = w[src]
    return out


def _rows(w) -> int:
    return (w.weight if isinstance(w, NVFP4Tensor) else w).shape[0]


def _cat(a, b):
    if isinstance(a, NVFP4Tensor):
        return NVFP4Tensor(*(torch.cat([x, y]) for x, y in zip(a.parts, b.parts)))
    return torch.cat([a, b])
