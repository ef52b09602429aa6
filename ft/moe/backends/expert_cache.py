"""The GPU expert cache of one MoE layer: S slots on the device and the table kernels read.

Two halves:

- ``SlotMap`` (host, numpy; ``slot_map.py``): expert -> slot, the eviction policy, pins, and
  hit / miss counts. It decides; it never touches a device tensor.
- ``ExpertCache`` (device, here): the slot block ``[S + 1, expert_bytes]`` in the bank's layout
  (``layout.py``) and the device-side table ``expert -> slot`` that kernels read, so remapping
  routed expert ids to slot ids is one gather on the device (``table[ids]``), inside CUDA graphs.

Row S is the *null expert*: all zeros, so its output is exactly zero whatever its routing weight.
An expert that is not resident maps to it; the hybrid backend relies on that to run the hits on
the GPU while the CPU computes the misses, without the GPU adding anything for them.
"""

from __future__ import annotations

import numpy as np
import torch

from ft.moe.backends.layout import ExpertLayout
from ft.moe.backends.slot_map import SlotMap, StackedMaps


class Upload:
    """Host values into a device tensor on the current stream (ordered before the kernels launched
    after it) without waiting for the device, and without changing the bytes of a copy still
    queued (deferred host reads publish while the GPU runs): the pinned mirror is rewritten only
    once its last copy has run, else a fresh one takes its place (torch's caching host allocator
    keeps the old one until its copy has run)."""

    def __init__(self) -> None:
        self.mirror: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def __call__(self, dst: torch.Tensor, values: np.ndarray) -> None:
        if dst.device.type != "cuda":  # a CPU "device" copies at once
            dst.copy_(torch.from_numpy(values))
            return
        if self.mirror is None or self.mirror.shape != values.shape or not self.done.query():
            self.mirror = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
        self.mirror.numpy()[...] = values
        dst.copy_(self.mirror, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()


class ExpertCache:
    """One layer's slots on the device and the device-side expert -> slot table."""

    def __init__(self, layout: ExpertLayout, slot_map: SlotMap, device: torch.device, spare: int = 0) -> None:
        """``spare``: rows past the null one that host reads' prefetch fills (``host_prefetch.py``)."""
        self.layout, self.map, self.device = layout, slot_map, device
        # [S + 1 + spare, bytes]: row S null, then the spare rows
        self.block = layout.allocate(slot_map.num_slots + 1 + spare, device)
        self.tensors = layout.views(self.block)  # name -> [S + 1 + spare, *shape]
        self.spare = spare
        self.table = torch.tensor(slot_map.slot_of, device=device)  # [E] a copy; static ones mapped
        # the route of an expert not (yet) in a slot: host row e - R, as -(row + 1)
        self.host_route = -(np.arange(slot_map.num_experts) - slot_map.static + 1)
        self._upload = Upload()  # the table, or with host reads' route the two at once (``tables``)
        self.map.dirty = False
        self.route: torch.Tensor | None = None  # [E] slot, or -(host row + 1): host reads' table
        self.tables: torch.Tensor | None = None  # [2, E] the table and the route, adjacent
        self.copying: dict[int, torch.cuda.Event] = {}  # slot -> its latest copy, until it lands

    def add_route(self, tables: torch.Tensor) -> None:
        """The table host reads take (``host_reads.py``): expert -> its slot where it is resident
        and the slot's last copy has landed, else -(host row + 1), a row of the host store (which
        holds every expert that is not static). Kernels reading it wait for nothing. ``tables``
        ([2, E] int64 on the device: the slot table, then the route) become this layer's tables,
        written in one copy by its own ``publish``: a layer's rows of one tensor for every layer,
        which ``Tables.publish`` writes in one copy."""
        self._published = self._route_values()
        tables[0].copy_(self.table)
        tables[1].copy_(torch.from_numpy(self._published))
        self.tables, self.table, self.route = tables, tables[0], tables[1]

    def filling(self, slots: list[int], done: torch.cuda.Event | None) -> None:
        """``slots`` are being copied into until ``done`` (None: already done, on a CPU)."""
        if self.route is not None and done is not None:
            self.copying.update(dict.fromkeys(slots, done))

    def published(self) -> np.ndarray:
        """[E] the route last published (what a host-read step since read): a slot, or < 0."""
        return self._published

    def _land(self) -> None:
        """Forget the copies that have landed; their experts' routes change (``dirty``)."""
        done: dict[int, bool] = {}  # an issue's slots share its event: each queried once
        landed = []
        for s, ev in self.copying.items():
            if id(ev) not in done:
                done[id(ev)] = ev.query()
            if done[id(ev)]:
                landed.append(s)
        for s in landed:
            del self.copying[s]
        self.map.dirty |= bool(landed)

    def filling_experts(self) -> np.ndarray:
        """The experts whose slot is still being copied into (they are read from the host)."""
        if not self.copying:
            return np.zeros(0, dtype=np.int64)
        held = self.map.expert_in[list(self.copying)]
        return held[held >= 0]

    def _route_values(self) -> np.ndarray:
        m = self.map
        ready = m.slot_of != m.null
        ready[self.filling_experts()] = False
        assert ready[: m.static].all(), "static experts live in their slots only"
        return np.where(ready, m.slot_of, self.host_route)

    @property
    def nbytes(self) -> int:
        return self.block.numel() + self.table.numel() * 8

    def publish(self) -> None:
        """Write the host map into this layer's device tables, when it changed (copies that
        landed included): ``Upload``, on the current stream, ordered before kernels, never
        waiting for the device."""
        if self.copying:
            self._land()
        if not self.map.dirty:
            return
        if self.route is None:
            self._upload(self.table, self.map.slot_of)  # through a pinned mirror of its own
        else:  # both rows in one copy; a fresh array: a deferred step keeps the one it read
            self._published = self._route_values()
            self._upload(self.tables, np.stack((self.map.slot_of, self._published)))
        self.map.dirty = False

    def slot_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]  # [T, k] slots; the null slot where an expert is not resident


class Tables:
    """Every layer's device tables in one tensor ``[L, 2, E]`` (table, route), so that host reads
    publish all layers between steps in one copy instead of two per changed layer (each copy a
    pinned mirror, a memcpy and an event: on an H200's host, 2026-12-01, ``publish`` took 50 us
    a layer and a step, 2.4 ms of host work a step for 48 layers), computed from every layer's
    map at once (``StackedMaps``). A layer's own ``publish`` (the copying decode path, mid-step)
    still writes its rows alone."""

    def __init__(self, caches: list[ExpertCache], device: torch.device) -> None:
        self.caches = caches
        self.maps = StackedMaps([c.map for c in caches])
        m = caches[0].map
        assert len({c.map.static for c in caches}) == 1, "every layer keeps the same static experts"
        self.values = torch.empty(len(caches), 2, m.num_experts, dtype=torch.int64, device=device)
        for i, c in enumerate(caches):
            c.add_route(self.values[i])
        self._upload = Upload()

    def publish(self) -> None:
        """Every layer's tables from its map, in one copy when any changed: an expert routes to
        its slot once the slot's last copy has landed (``ExpertCache.copying``), else to the host.
        Each layer's ``published`` route becomes a row of a fresh array (a deferred step keeps
        the one it read)."""
        dirty = False
        for c in self.caches:
            if c.copying:
                c._land()
            dirty |= c.map.dirty
        if not dirty:
            return
        slot_of, static = self.maps.slot_of, self.caches[0].map.static
        ready = slot_of != self.caches[0].map.null
        for i, c in enumerate(self.caches):
            if c.copying:  # still being copied: read from the host
                ready[i, c.filling_experts()] = False
        assert ready[:, :static].all(), "static experts live in their slots only"
        host = self.caches[0].host_route  # every layer's (the same static experts)
        values = np.stack((slot_of, np.where(ready, slot_of, host)), axis=1)  # [L, 2, E]
        for i, c in enumerate(self.caches):
            c._published = values[i, 1]
            c.map.dirty = False
        self._upload(self.values, values)
