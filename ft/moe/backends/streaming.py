"""The offload backend's streamed path: a batch whose experts do not fit a layer's slots (prefill)
computed from experts copied through the staging buffers, group by group.

Prefill (and any batch whose experts do not fit): the chunk's experts are streamed. Resident
ones, static ones included, are used in place (one kernel call on the slots), or, with
``--moe-prefill-hit-d2d``, copied device-to-device into staging with the rest; the others go
host -> staging in groups of B experts, through ``sizing.STAGING_BUFFERS`` buffers taken in turn
(groups g + 1 .. are copied while group g computes). A group runs the kernel on the pairs
(token, k) routed into it, k = 1 each, summed into an fp32 accumulator. Prefill never inserts
into the cache (a long prompt would flush the decode working set); its accesses still count for
the policy. Experts pre-staged while the engine was idle (``prestage.py``) are computed where
they are, in one more call.

Streaming ahead (``--moe-stream-ahead``, on; ``--no-moe-stream-ahead`` turns it off): a batch with
at least ``AHEAD_PAIRS`` (token, k) pairs per expert routes to nearly every expert of every
layer, so the next layer's host-only experts are needed before its router says so. Once a layer
has queued its last group, the staging buffers are filled with the next layer's first groups
(``staging.AHEAD_GROUPS``, each once this layer's group before it in that buffer has been read; the
host-only experts it is predicted to use most: the prefetch router's picks, else the policy's use
counts), so the copy engine keeps streaming through that layer's attention or GDN
mixer and its router instead of idling until the router's ids reach the host. The first MoE
layer of a prefill, which no layer before it stages for, stages its own before its mixer
(``OffloadBackend.lookahead``). The next layer computes the staged experts that its routing hits
and streams the rest; an expert staged but not routed to costs its copy, never a result.

Each function takes the layer's ``OffloadBackend``. Not here: the decode paths and the entry that
picks a path (``offload``), the staging buffers and what the layers share (``staging``), the CPU's
share of a streamed layer (``hybrid``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from ft.moe.backends import pairs
from ft.moe.backends.host_route import HostRoute
from ft.moe.backends.pairs import Terms
from ft.moe.backends.staging import Ahead, Prestaged

if TYPE_CHECKING:
    from ft.moe.backends.offload import OffloadBackend

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


def stream(
    backend: OffloadBackend,
    bank,
    x,
    weights,
    route: HostRoute,
    experts: np.ndarray,
    ahead: Ahead | None,
    shared=None,
) -> torch.Tensor:
    sh, st = backend.shared, backend.shared.staging
    ids = route.ids  # [T, k] on the device
    hit = backend.map.classify(experts)
    terms = Terms(x, weights.shape[1], shared is not None)  # [T, k (+ 1), H]
    early = np.isin(experts, ahead.experts) if ahead is not None else np.zeros(len(experts), dtype=bool)
    in_place = np.zeros_like(hit) if sh.hit_d2d else hit & ~early  # resident, used in their slots
    pre = sh.prestaged.pop(backend, None)  # experts copied while the engine was idle
    from_pre = np.zeros_like(hit) if pre is None else ~early & ~in_place & np.isin(experts, pre.experts)
    staged = experts[~early & ~in_place & ~from_pre]
    on_cpu = backend._cpu_share(bank, x, weights, route, staged[~backend.map.resident(staged)])
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
        ready[g] = ready[g] or stage(backend, groups[g])
    if on_cpu is not None:  # its rows to the host once the link is busy
        on_cpu.start(x, weights)
    # the pairs are grouped once the first copies are on their way (the link waits for nothing),
    # unless the CPU's share grouped them already
    resident = experts[in_place]
    calls = [(resident, backend.map.slot_of[resident])] + [(g, np.arange(len(g))) for g in groups]
    if pre is not None:  # one more call, last: its rows in the pre-staged buffer
        used = experts[from_pre]
        calls.append((used, np.searchsorted(pre.experts, used)))
    if on_cpu is None and pairs.DEVICE_PAIRS:
        runs = pairs.device_runs(ids, weights, calls, route.counts)
    else:
        grouped = on_cpu.pairs if on_cpu is not None else pairs.Pairs(route.ids_h, backend.store.num_experts)
        runs = pairs.upload_pairs([grouped.of(*call) for call in calls], weights)
    # the hits in place first, unless a group staged ahead can go first: its kernel frees a
    # buffer, so the next group streams while the hits compute (the order is fixed by whether
    # groups were staged ahead, not by timing: the same sums every run)
    hits_later = HITS_AFTER_AHEAD and ahead is not None and len(ahead.groups) > 0
    if not hits_later:  # what is on the device already, while the groups stream
        run_in_place(backend, bank, x, terms, runs, pre)
    for g in range(len(groups)):
        buf, event = ready[g]
        sh.transfer.wait(event)
        terms.run(bank, st.tensors[buf], x, *runs[g + 1])
        st.free_after[buf] = sh.transfer.record_main()
        if g + n < len(groups):  # into the buffer group g has just been read from
            ready[g + n] = stage(backend, groups[g + n])
        if g == 0 and hits_later:  # group 0 has freed its buffer for the next group's copy
            run_in_place(backend, bank, x, terms, runs, pre)
    # its term, as the fused call adds it after the routed ones (issued now, added last)
    shared_term = shared_pair_alone(x, shared) if shared is not None else None
    backend._prefetch_next(route.predicted_experts)  # before staging ahead: the next layer waits for it
    if backend.next is not None and streams_ahead(backend, len(x), weights.shape[1]):
        stage_first_groups(backend.next, route.predicted)
    if on_cpu is not None:  # the host computes its share while the GPU runs what it was given
        on_cpu.add_to(bank, backend.store, terms)
    return terms.total(shared_term)


def run_in_place(backend: OffloadBackend, bank, x, terms: Terms, runs, pre: Prestaged | None) -> None:
    """The pairs of experts already on the device: those pre-staged while the engine was idle
    (``runs[-1]``, once their copies have landed), then the hits in their slots (``runs[0]``)."""
    if pre is not None:
        backend.shared.transfer.wait(pre.ready)
        terms.run(bank, pre.tensors, x, *runs[-1])
        backend.shared.prestage_used += len(runs[-1][0]) > 0
    terms.run(bank, backend.cache.tensors, x, *runs[0])


def take_ahead(backend: OffloadBackend) -> Ahead | None:
    """The group staged for this layer, if any; any other is dropped (a forward that stopped
    between the two layers: its buffer may be refilled before that layer runs again)."""
    ahead, backend.shared.ahead = backend.shared.ahead, None
    return ahead if ahead is not None and ahead.backend is backend else None


def streams_ahead(backend: OffloadBackend, tokens: int, top_k: int) -> bool:
    """Whether a batch of ``tokens`` stages layers' first groups ahead of their routers
    (``--moe-stream-ahead``): at least ``AHEAD_PAIRS`` (token, k) pairs per expert, so it
    routes to nearly every expert of every layer."""
    sh = backend.shared
    return (
        sh.stream_ahead
        and sh.staging is not None
        and tokens * top_k >= AHEAD_PAIRS * backend.store.num_experts
    )


def stage_first_groups(backend: OffloadBackend, predicted: np.ndarray | None) -> None:
    """Stage this layer's likeliest host-only experts into ``Staging.ahead`` groups before its
    router runs (``predicted``: the prefetch router's picks for it per expert, else the policy's
    use counts rank them). Called by the previous layer once it has queued its last group: each goes
    into the next buffer in turn, its copy waiting for that layer's kernel that reads the
    buffer before it, so that the buffers stream through this layer's mixer and router; or by
    this layer's lookahead, before its mixer."""
    host_only = backend.map.absent() if backend.map is not None else []
    pre = backend.shared.prestaged.get(backend)
    if pre is not None:  # those are on the device already
        host_only = host_only[~np.isin(host_only, pre.experts)]
    if len(host_only) == 0:
        return
    freq = backend.map.freq
    use = freq if predicted is None else predicted
    rows, ahead = backend.shared.staging.rows, backend.shared.staging.ahead
    ranked = host_only[np.argsort(-use[host_only], kind="stable")][: ahead * rows]
    groups = [np.sort(ranked[i : i + rows]) for i in range(0, len(ranked), rows)]
    before = backend.shared.transfer.record_copies()  # what this layer waits for at its start
    backend.shared.ahead = Ahead(backend, groups, [stage(backend, group) for group in groups], before)


def stage(backend: OffloadBackend, group: np.ndarray) -> tuple[int, torch.cuda.Event | None]:
    """Copy a group of experts into the next staging buffer; returns the buffer and the event
    its reader waits on. Resident experts go device-to-device (``hit_d2d``), the others from
    the host store."""
    sh = backend.shared
    st, tr = sh.staging, sh.transfer
    buf, sh.next_buf = sh.next_buf, (sh.next_buf + 1) % len(st.blocks)
    rows = np.arange(len(group))
    on_device = backend.map.resident(group)
    after = st.free_after[buf]
    ev_d2d = tr.issue(
        st.blocks[buf], rows[on_device].tolist(), backend.cache.block,
        backend.map.slot_of[group[on_device]].tolist(), after=after, h2d=False,
    )  # fmt: skip
    ev_h2d = tr.issue(
        st.blocks[buf],
        rows[~on_device].tolist(),
        backend.store.block,
        backend.store.rows(group[~on_device]).tolist(),
        after=after,
    )
    return buf, (ev_h2d if ev_h2d is not None else ev_d2d)  # one stream: the later covers both
