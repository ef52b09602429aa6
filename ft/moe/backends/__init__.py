"""MoE backends: where a layer's routed experts live and how a batch reaches them.

A backend is a callable ``backend(bank, x, weights, ids) -> [T, H]`` (this rank's partial sum of
the routed experts) held by each ``SparseMoeBlock``; the block adds its shared expert and does
the one reduce. A backend with ``shared_pair`` also takes ``shared=(gate_up, down, logit)`` and
returns the shared expert's term in the sum (``triton_moe_gemv.SHARED_AS_PAIR``). The bank keeps
the format (bf16, NVFP4) and the kernel; the backend keeps the placement:

- ``gpu``      every expert resident on the device, the kernel reads the bank (``gpu.py``).
- ``offload``  experts in a pinned host store, a per-layer GPU slot cache with an LRU or
               frequency-aware policy, misses copied over PCIe on a side stream, the next
               layer's experts prefetched from its router (``offload.py``), prefill streamed
               through staging buffers taken in turn (``streaming.py``). When the host cannot
               hold every expert, some live on the GPU only (a lean store, ``placement.py``).
- ``hybrid``   as offload, but at small decode batches the misses are computed on the CPU from
               the host store while the hits run on the GPU (``hybrid.py``).
- ``cpu``      every routed expert computed on the CPU from the host store (``cpu.py``).

Chosen once at start-up (``runtime.MoeRuntime``); the output never depends on the choice, the
cache size, the policy or the prefetch predictions, only the speed does. This module also holds
the build-time switch that keeps bank parameters off the device while the model is built
(``banks_on``): an offloading engine must never allocate all experts on the GPU first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BACKENDS = ("gpu", "offload", "hybrid", "cpu")
OFFLOADING = ("offload", "hybrid", "cpu")  # keep the experts in the host store

_BANK_DEVICE: torch.device | None = None


@contextlib.contextmanager
def banks_on(device: torch.device | str | None) -> Iterator[None]:
    """While a model is built, allocate expert-bank parameters on ``device`` (None: where the
    rest of the model goes). ``meta`` leaves them unallocated for the host store to adopt."""
    global _BANK_DEVICE
    if _BANK_DEVICE is not None:
        raise RuntimeError(f"banks_on({_BANK_DEVICE}) is already active; contexts do not nest")
    _BANK_DEVICE = torch.device(device) if device is not None else None
    try:
        yield
    finally:
        _BANK_DEVICE = None


def bank_device() -> torch.device | None:
    return _BANK_DEVICE
