"""The offloading MoE layers' backends: built once the host stores, caches and staging exist,
linked to the next layer's, and their caches filled, at start-up (``build``) and again for each
variant ``ft bench offline`` measures (``restart``).

Not here: which backend, how many slots or staging rows (``runtime``, ``sizing``), what a backend
does with a batch (``offload``, ``hybrid``, ``cpu``).
"""

from __future__ import annotations

import torch

from ft.moe.backends.cpu import CpuBackend
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.host_reads import HostReads
from ft.moe.backends.host_store import HostStore
from ft.moe.backends.hybrid import HybridBackend
from ft.moe.backends.offload import OffloadBackend
from ft.moe.backends.prefetch import Prefetch
from ft.moe.backends.staging import Shared


def build(
    name: str,
    blocks: list,
    stores: list[HostStore],
    caches: list[ExpertCache],
    shared: Shared,
    prefetch: bool,
) -> list:
    """Give every MoE block (``blocks``) its ``name`` backend and return them in layer order: each
    linked to the next layer's (streaming ahead; with ``prefetch``, that layer's router), every
    cache filled from its host store."""
    backends = []
    for i, (block, store) in enumerate(zip(blocks, stores)):
        if name == "cpu":
            backend = CpuBackend(store, shared, first=i == 0)
        else:
            cls = HybridBackend if name == "hybrid" else OffloadBackend
            backend = cls(store, caches[i], shared, first=i == 0)
        block.backend = backend
        backends.append(backend)
    if name != "cpu":  # streaming ahead (offload, hybrid): the next layer's first group
        for backend, nxt in zip(backends, backends[1:]):
            backend.next = nxt
    for backend in backends:  # fill every cache at start-up: copies on the side stream
        if getattr(backend, "cache", None) is not None:
            backend.copy_in(backend.map.warm())
            backend.cache.publish()
    shared.transfer.wait()  # the main stream reads no slot before its copy lands
    shared.transfer.reset_counts()  # bytes streamed per token count requests' traffic only
    if prefetch:
        for backend, nxt, block in zip(backends, backends[1:], blocks[1:]):
            backend.prefetch = Prefetch(block.gate, nxt)  # the next MoE layer's router
    return backends


def restart(
    backends: list, caches: list[ExpertCache], shared: Shared, reads: HostReads | None, device: torch.device
) -> None:
    """Every expert cache back to its start-up fill (``SlotMap.restart``), copied in now, so that
    each variant ``ft bench offline`` measures on one loaded model starts from the same contents
    instead of the previous variant's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # no kernel or copy still on a slot
    shared.prestaged.clear()  # ranked by the variant before: the next stages its own
    shared.ahead = None
    if reads is not None:
        reads.flush()
        reads.discard()
    for backend in backends:
        cache = getattr(backend, "cache", None)
        if cache is not None:
            cache.copying.clear()
            backend.copy_in(backend.map.restart())
    shared.transfer.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # landed, and not part of what is measured next
    if reads is not None:
        reads.tables.publish()  # every slot routed to now: its copy has landed
    else:
        for cache in caches:
            cache.publish()
