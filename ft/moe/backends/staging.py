"""The device buffers the offload backend streams experts through, and what the offloading layers
of one rank share.

``Staging``: a few buffers of B expert rows, taken in turn by the layers of a rank (one runs at a
time): a streamed layer copies its missed experts into them group by group, each group's copy
waiting for the kernel that last read its buffer. ``Ahead``: the first groups a layer stages for
the next one before that layer's router has run (streaming ahead, ``AHEAD_GROUPS``).
``Prestaged``: a layer's host-only experts copied while the engine was idle into a buffer of their
own (``PRESTAGE``); ``prestage_rows`` shares the idle room out among the layers. ``Shared``: the
copy engine, the staging buffers, the step count and the statistics the layers of a rank share.
Not here: which experts a layer stages or when (``streaming``, ``prestage``), how many rows the
buffers get (``sizing``, ``MoeRuntime.allocate``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ft.moe.backends.layout import ExpertLayout
from ft.moe.backends.slot_map import SlotCounts
from ft.moe.backends.transfer import Transfer

if TYPE_CHECKING:
    from ft.moe.backends.offload import OffloadBackend

# groups staged ahead, at most one a staging buffer (0: one in each): 1 gained 2% on the 8k prefill
# (554 -> 542 ms, 16 layers, one H200, 2026-12-01); 1 and 2 on that cut 438 / 437 ms, link busy
# 84% / 85% (2026-12-02, no same-day row without); 2 with the first layer's own staging on the
# full 80B bf16 at --memory-ratio 0.94: 8k prefill 9,114 -> 10,990 tok/s (61 -> 74% of the link)
AHEAD_GROUPS = max(0, int(os.environ.get("FT_MOE_AHEAD_GROUPS", "0")))
# Pre-staging (``prestage.py``): when the engine falls idle (``MoeRuntime.idle``), MoE layers'
# host-only experts, the policy's likeliest first, are copied into buffers of their own, on a stream
# of their own, in what the plan leaves an idle engine (``prestage.room_when_idle``, kept as
# ``Shared.prestage_room``), shared out evenly over the layers (``prestage_rows``), so that the
# next prefill computes them where they are and every layer streams only the rest. A 1k prompt
# touches every expert of every layer, and the full 80B's TTFT (561 ms on an H200, 2026-12-03) is
# the link's 0.54 s for its misses; a request that finds the engine idle would skip the pre-staged
# experts' share of it.
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
    engine was idle (``prestage.copy``); ``ready``: the event its readers wait on."""

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
    tokens: int = 0  # real tokens of every forward (``MoeRuntime.after_step``; for bytes per token)
    cpu_pairs: int = 0  # (token, expert) pairs computed on the CPU (hybrid, cpu)
    prestaged: dict = field(default_factory=dict)  # backend -> Prestaged, in layer order
    # pre-staging's copies on a stream of their own (the same counts): a layer that waits for
    # every copy issued before it (prefetches into its slots) does not wait for later layers'
    prestage_transfer: Transfer | None = None
    prestage_room: int = 0  # bytes pre-staged layers and a batch's activations share (set when idle)
    activation_per_token: int = 0  # a batch's activations a token (``sizing.activation_bytes_per_token``)
    prestage_used: int = 0  # pre-staged layers a batch then computed (tests read it)

    def begin_step(self) -> None:
        """A forward starts: every layer's slot map pins for a new step."""
        self.step += 1
        for m in self.maps:
            m.begin_step(self.step)

    def reset_counts(self) -> None:
        """Every count back to zero (``MoeRuntime.discard_uses``): the maps' uses, evictions and
        prefetches, the copies' bytes and time, the tokens, the pairs on the CPU, the layers
        computed from pre-staged or staged-ahead experts."""
        for m in self.maps:
            m.counts = SlotCounts()
        self.transfer.reset_counts()
        if self.prestage_transfer is not None:  # its copies go into the same counts
            self.prestage_transfer.reset_counts()
            self.prestage_transfer.counts = self.transfer.counts
        self.tokens = self.cpu_pairs = self.prestage_used = self.ahead_used = 0

    def fit_prestaged(self, num_tokens: int) -> None:
        """Keep the pre-staged layers, the first ones first, that leave a batch of ``num_tokens``
        room for its activations; drop the others (their buffers go back to the allocator, which
        hands them out again once their copies have landed: ``prestage.copy``)."""
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
