"""What the host reads of a streamed MoE layer's routing: the offload backend's one synchronisation
a layer (``OffloadBackend._route``), as per-expert counts of the batch's (token, k) pairs and of the
prefetch router's picks. Small batches copy their ids and count them on the host; from
``DEVICE_COUNTS_MIN_PAIRS`` pairs the counts are made on the device and only they are copied.
Not here: what the backend does with them (``offload.py``), host reads' routing, which never
reaches the host (``host_reads.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

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


def host_route(
    ids: torch.Tensor, pred: torch.Tensor | None, num_experts: int, real: torch.Tensor | None = None
) -> HostRoute:
    """``ids`` [T, k] (and ``pred``, the guess) read by the host: the layer's synchronisation.
    ``real`` [T] bool: the rows counted (a replayed decode graph's padding rows route too, and
    their experts would be copied in and prefetched for nothing); None: all."""
    e, k = num_experts, ids.shape[1]
    if ids.numel() < DEVICE_COUNTS_MIN_PAIRS:
        rows = [] if real is None else [real[:, None].to(ids.dtype)]
        parts = [ids] + ([] if pred is None else [pred]) + rows
        h = torch.cat(parts, dim=1).cpu().numpy() if len(parts) > 1 else ids.cpu().numpy()  # one copy
        copied = h[:, :k]
        if real is not None:
            h = h[h[:, -1] != 0]  # the real rows (``ids_h`` stays every row of ``ids``)
            copied = None
        guess = None if pred is None else np.bincount(h[:, k : k + pred.shape[1]].reshape(-1), minlength=e)
        return HostRoute(np.bincount(h[:, :k].reshape(-1), minlength=e), guess, ids, copied)
    flat = ids.reshape(-1) if pred is None else torch.cat([ids.reshape(-1), pred.reshape(-1) + e])
    flat = flat.long()
    ones = torch.ones_like(flat)
    if real is not None:  # [T] -> a weight a pair, the guess's pairs after the batch's
        shapes = [ids.shape] + ([] if pred is None else [pred.shape])
        ones = torch.cat([real[:, None].expand(shape).reshape(-1) for shape in shapes]).long()
    counts = torch.zeros(2 * e if pred is not None else e, dtype=torch.int64, device=ids.device)
    counts = counts.scatter_add_(0, flat, ones).cpu().numpy()  # (bincount syncs twice more)
    return HostRoute(counts[:e], None if pred is None else counts[e:], ids)
