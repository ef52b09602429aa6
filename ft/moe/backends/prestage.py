"""Pre-staging (``staging.PRESTAGE``): while the engine is idle, the offloading layers' likeliest
host-only experts copied into buffers of their own, so that the next prefill computes them where
they are and streams only the rest (``streaming.run_in_place``).

``idle`` (``MoeRuntime.idle`` calls it) measures the room the plan leaves an idle engine
(``room_when_idle``), shares it out over the layers (``staging.prestage_rows``) and has each layer
copy its share (``copy``). Not here: the buffers and the switch (``staging``: ``Prestaged``,
``PRESTAGE``), the layers a batch drops before its forward (``Shared.fit_prestaged``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ft.config import EngineConfig
from ft.engine import allocator
from ft.moe.backends import sizing, staging
from ft.moe.backends.staging import Prestaged, Shared
from ft.moe.backends.transfer import Transfer

if TYPE_CHECKING:
    from ft.moe.backends.offload import OffloadBackend


def idle(cfg: EngineConfig, device: torch.device, sh: Shared, backends: list[OffloadBackend]) -> None:
    """Copy the layers' (``backends``) host-only experts into buffers of their own, as many as
    ``prestage_room`` holds, shared out over the layers by ``staging.prestage_rows`` (the layers
    already pre-staged count, and keep theirs)."""
    held = sum(p.nbytes for p in sh.prestaged.values())
    if device.type == "cuda":
        sh.prestage_room = room_when_idle(cfg, device, held)
    each = max(b.store.layout.expert_bytes for b in backends)  # the layers' experts alike
    capacity = [len(host_only(b)) for b in backends]
    rows = staging.prestage_rows((sh.prestage_room - held) // each, capacity)
    for backend, n in zip(backends, rows):
        try:
            copy(backend, n)
        except torch.cuda.OutOfMemoryError:  # best effort: the room was measured, not reserved
            break
    sh.prestaged = {b: sh.prestaged[b] for b in backends if b in sh.prestaged}  # layer order


def room_when_idle(cfg: EngineConfig, device: torch.device, prestaged: int) -> int:
    """Bytes the plan (the cap x ``--memory-ratio``) leaves an idle engine for pre-staged
    layers, those it holds (``prestaged``) included: less what lies outside torch's allocator
    (the CUDA context), every live tensor but theirs (the CUDA graphs' pools among them) and
    ``staging.PRESTAGE_MARGIN``. Blocks the allocator caches but no tensor holds count as
    room: a pre-staged buffer takes them before it asks the driver."""
    context, total = allocator.outside(device)
    live = torch.cuda.memory_allocated(device) - prestaged
    return sizing.plan_bytes(cfg, device, total) - context - live - staging.PRESTAGE_MARGIN


def host_only(backend: OffloadBackend) -> np.ndarray:
    """The host-only experts this layer could pre-stage now (none when it holds some already)."""
    if backend.map is None or backend in backend.shared.prestaged:
        return np.empty(0, dtype=np.int64)
    return backend.map.absent()


def copy(backend: OffloadBackend, max_rows: int) -> None:
    """Copy up to ``max_rows`` of this layer's host-only experts, those its policy ranks first,
    into a buffer of their own (``host_only`` says which it could)."""
    candidates = host_only(backend) if max_rows > 0 else []
    if len(candidates) == 0:
        return
    ranked = candidates[np.argsort(-backend.map.freq[candidates], kind="stable")][:max_rows]
    experts = np.sort(ranked)
    layout, sh = backend.store.layout, backend.shared
    block = layout.allocate(len(experts), backend.cache.block.device, zero=False)
    if sh.prestage_transfer is None:
        sh.prestage_transfer = Transfer(sh.transfer.device)
        sh.prestage_transfer.counts = sh.transfer.counts
    ready = sh.prestage_transfer.issue(
        block, list(range(len(experts))), backend.store.block, backend.store.rows(experts).tolist()
    )
    if block.is_cuda:  # freed however (consumed, dropped, the engine closed), reused only once copied
        block.record_stream(sh.prestage_transfer.stream)
    sh.prestaged[backend] = Prestaged(experts, block, layout.views(block), ready)
