"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
finishing: its programs start, wait (``griddepcontrol.wait``) until that kernel's memory is
visible, then run, so the launch latency between two small kernels overlaps the first one's tail.
A decode step is hundreds of kernels of a few microseconds each (docs/benchmarks.md), so the gap
at each boundary is a share of the step worth removing. Every kernel that takes part waits first
thing, before any load or store, so nothing it reads or writes can race the kernel before it;
kernels that do not take part launch as usual. CUDA graphs keep the launch attribute.

On by default, in its ``EARLY`` mode (timed on an H200, docs/benchmarks.md 2026-11-30 06:00 UTC:
batch-1 decode of the 24-layer Qwen3-Next 411.8 -> 431.6 tok/s, same tokens bit for bit).
``FT_PDL=0`` turns it off for a process and the ranks it spawns (``FT_PDL=wait``: wait only):
``pdl_args`` then passes nothing, and the kernels' ``USE_PDL=False`` default compiles no wait.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_MODE = os.environ.get("FT_PDL", "early")  # for a process and the tensor-parallel ranks it spawns
if _MODE not in ("0", "off", "1", "wait", "early"):
    raise ValueError(f"FT_PDL={_MODE!r}: expected 0 (off), wait, or early (the default)")
ENABLED = _MODE in ("1", "wait", "early")
# With ENABLED (FT_PDL=early): also let the next kernel launch as soon as this one has waited
# (each kernel still waits for its own predecessor), instead of when this one's programs exit.
# More overlap, but the early programs hold SM slots while they wait: a kernel of several waves
# may lose to it.
EARLY = _MODE == "early"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a GPU of sm_90 or later (PDL here)."""
    return t.is_cuda and _capability(t.device.index or 0) >= (9, 0)


_OFF: dict = {}  # the kernels' defaults: USE_PDL=False, no launch attribute, nothing for Triton to bind


def pdl_args(t: torch.Tensor) -> dict:
    """The launch keywords for a kernel on ``t``'s device: its ``USE_PDL`` and the launch option
    when PDL is on there, none otherwise (the eager prefill path launches ~800 kernels a step)."""
    if ENABLED and hopper(t):
        return {"USE_PDL": 2 if EARLY else 1, "launch_pdl": True}
    return _OFF


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    # the first statement of a kernel that takes part: the previous kernel's writes are visible after
    # (USE_PDL 1), and with 2 the next kernel may launch from here on (``EARLY``)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
