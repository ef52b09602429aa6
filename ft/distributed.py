"""Tensor-parallel identity of this process and the few collectives the model needs.

A layer reads ``get_tp_info()`` once, at construction, to size its shard and keeps the TPInfo for
its forward. The info is set by ``tp_context`` around model construction (by the engine for real
ranks, by ``ft info`` for simulated ranks on the meta device). Outside such a context
``get_tp_info()`` raises and ``try_get_tp_info()`` returns None, so config parsing and tooling run
without an engine. This module does not start processes; ``ft.engine.executor`` does.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int
    group: object | None = None  # torch ProcessGroup; None for one rank or a simulated rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} out of range for tp size {self.size}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_TP: TPInfo | None = None


@contextlib.contextmanager
def tp_context(info: TPInfo) -> Iterator[TPInfo]:
    """Make ``info`` this process's tensor-parallel identity while a model is built."""
    global _TP
    if _TP is not None:
        raise RuntimeError(f"tp_context is already active ({_TP}); contexts do not nest")
    _TP = info
    try:
        yield info
    finally:
        _TP = None


def get_tp_info() -> TPInfo:
    if _TP is None:
        raise RuntimeError("no tensor-parallel context: build models inside ft.distributed.tp_context")
    return _TP


def try_get_tp_info() -> TPInfo | None:
    return _TP


_ALL_REDUCES: list[tuple[tuple[int, ...], torch.dtype]] | None = None


@contextlib.contextmanager
def recording_all_reduces() -> Iterator[list[tuple[tuple[int, ...], torch.dtype]]]:
    """Note the shape and dtype of every all-reduce ``all_reduce`` makes while active, in order
    (``ft bench offline --census`` times the same sequence with the ranks in step). The reduces
    themselves are unchanged; one rank makes none, so notes none."""
    global _ALL_REDUCES
    if _ALL_REDUCES is not None:
        raise RuntimeError("already recording all-reduces; recordings do not nest")
    _ALL_REDUCES = calls = []
    try:
        yield calls
    finally:
        _ALL_REDUCES = None


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``tp`` in place; a no-op on one rank."""
    if tp.size > 1:
        if _ALL_REDUCES is not None:
            _ALL_REDUCES.append((tuple(x.shape), x.dtype))
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension, in rank order."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def init_process_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> TPInfo:
    """Join the tensor-parallel group: NCCL for CUDA ranks, gloo on CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", init_method=init_method, rank=rank, world_size=size, timeout=timeout, device_id=device
        )
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TPInfo(rank=rank, size=size, group=dist.group.WORLD)


def local_threads_for(size: int) -> int:
    """CPU threads per rank so P ranks on one host do not oversubscribe its cores."""
    return max(1, (os.cpu_count() or 1) // size)
