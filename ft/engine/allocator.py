"""The CUDA caching allocator's mode for the engine's allocations.

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
