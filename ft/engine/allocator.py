"""The CUDA caching allocator's limit and mode for the engine's allocations.

``--max-gpu-memory`` stands for a smaller card (48 GiB on an H200): the plan sizes everything
for it, and ``cap`` holds torch's allocator to it too (``torch.cuda.set_per_process_memory_fraction``),
so that what the allocator's cache grows to beyond the plan meets the limit a card of that
size has, where the allocator frees its cached blocks and retries, or runs out, as it would
there. Without the cap the allocator may take the whole H200, and a figure measured "under
48 GiB" may have used more.

By default torch's allocator carves each allocation it cannot serve from its cache out of a new
segment of that size, and a freed block only merges with free neighbours of its own segment. A
prefill allocates tensors of hundreds of MiB whose sizes change from layer to layer and from
chunk to chunk, so the cache grows well past what is live at once: on an H200, the full
Qwen3-Next-80B offloaded (2026-12-03), a 16k-token chunk's allocations peaked 2.2 GiB above what
the engine held, while the allocator's reservation grew 10.6 GiB over the 1k, 8k and 16k
prefills, past the plan's 7 GiB activation reserve and its ``--memory-ratio`` (docs/benchmarks.md).
Expandable segments map pages into one growing range per stream instead, so freed memory serves
any later size.

``EXPANDABLE`` (``FT_EXPANDABLE_SEGMENTS=1`` for a process and the ranks it spawns) turns them on
for a CUDA engine's allocations from its start, unless the user configured the allocator
(``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``: theirs stands). Off until timed on a GPU:
the same bench with it on and off, and the offload backend's graphed decode with it on.
"""

from __future__ import annotations

import os

import torch

EXPANDABLE = os.environ.get("FT_EXPANDABLE_SEGMENTS", "0") == "1"
USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def outside(device: torch.device) -> tuple[int, int]:
    """(bytes in use on the CUDA ``device`` outside torch's allocator now: the CUDA context,
    libraries' own allocations; the device's total bytes)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, (total - free) - torch.cuda.memory_reserved(device)), total


def cap_fraction(cap: int | None, outside: int, total: int) -> float:
    """The share of the device's ``total`` bytes torch's allocator may reserve under a ``cap``
    (None: no cap): the cap less what lies ``outside`` the allocator (the CUDA context), which a
    card of the cap's size holds too."""
    if not cap or cap >= total:
        return 1.0
    return min(1.0, max(0.0, (cap - outside) / total))


def cap(max_bytes: int | None, device: torch.device) -> float | None:
    """Hold torch's allocator on a CUDA ``device`` to ``max_bytes`` (``--max-gpu-memory``), or
    lift an earlier engine's limit in this process when there is none; the fraction set."""
    if device.type != "cuda":
        return None
    fraction = cap_fraction(max_bytes, *outside(device))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def configure(device: torch.device) -> bool:
    """Turn on expandable segments for the allocations made from now on, where ``EXPANDABLE``
    asks for them on a CUDA ``device`` and the user left the allocator alone; whether it did."""
    if device.type != "cuda" or not EXPANDABLE or any(os.environ.get(v) for v in USER_SETTINGS):
        return False
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:  # older torch
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings("expandable_segments:True")
    return True
