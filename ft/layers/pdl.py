"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
finishing: its programs start, wait (``griddepcontrol.wait``) until that kernel's memory is
visible, then run, so the launch latency between two small kernels overlaps the first one's tail.
A decode step is hundreds of kernels of a few microseconds each (docs/benchmarks.md), so the gap
at each boundary is a share of the step worth removing. Every kernel that takes part waits first
thing, before any load or store, so nothing it reads or writes can race the kernel before it;
kernels that do not take part launch as usual. CUDA graphs keep the launch attribute.

``ENABLED`` (``FT_PDL=1``) is off until timed on a GPU (NOT yet run on one): ``pdl_args`` then
passes nothing, and the kernels' ``USE_PDL=False`` default compiles no wait: their behaviour
before this module.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# FT_PDL=1 (or "wait") turns it on for a process and the tensor-parallel ranks it spawns.
ENABLED = os.environ.get("FT_PDL", "") in ("1", "wait", "early")
# With ENABLED (FT_PDL=early): also let the next kernel launch as soon as this one has waited
# (each kernel still waits for its own predecessor), instead of when this one's programs exit.
# More overlap, but the early programs hold SM slots while they wait: a kernel of several waves
# may lose to it.
EARLY = os.environ.get("FT_PDL", "") == "early"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_OFF: dict = {}  # the kernels' defaults: USE_PDL=False, no launch attribute, nothing for Triton to bind


def pdl_args(t: torch.Tensor) -> dict:
    """The launch keywords for a kernel on ``t``'s device: its ``USE_PDL`` and the launch option
    when PDL is on there, none otherwise (the eager prefill path launches ~800 kernels a step)."""
    if ENABLED and t.is_cuda and _capability(t.device.index or 0) >= (9, 0):
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
