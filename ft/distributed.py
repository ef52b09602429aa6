"""Tensor-parallel identity of this process and the few collectives the model needs.

A layer reads ``get_tp_info()`` once, at construction, to size its shard and keeps the TPInfo for
its forward. The info is set by ``tp_context`` around model construction (by the engine for real
ranks, by ``ft info`` for simulated ranks on the meta device). Outside such a context
``get_tp_info()`` raises and ``try_get_tp_info()`` returns None, so config parsing and tooling run
without an engine. This module does not start processes; ``ft.engine.executor`` does.

Small bf16 all-reduces on CUDA can go over symmetric memory instead of NCCL (``SYMM_ALL_REDUCE``):
each rank copies its message into a buffer every rank of the group can read over NVLink, and one
kernel per rank reads every rank's copy and sums them (torch's ``symm_mem.one_shot_all_reduce``):
one copy and one launch, no ring steps. A decode step's all-reduces are a few KB each and about
a hundred a step on a 48-layer model, so their latency, not the link's bandwidth, is what TP=2
pays at small batches (docs/benchmarks.md). Larger messages, other dtypes and CPU ranks keep NCCL
or gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
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
# Off until timed (NOT yet run on a GPU): FT_SYMM_ALL_REDUCE=1, for a process and the ranks it spawns.
SYMM_ALL_REDUCE = os.environ.get("FT_SYMM_ALL_REDUCE", "0") == "1"
SYMM_MAX_BYTES = 1 << 18  # a 64-token decode step's [64, 2048] bf16 message


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
        group_all_reduce(x, tp.group)
    return x


def group_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place: over the group's symmetric buffer when it has one and
    ``x`` fits it, otherwise through its backend (NCCL, gloo)."""
    if not x.is_contiguous():  # gloo would sum the storage as if it were, other rows' values
        raise ValueError(f"an all-reduce sums a contiguous tensor in place, got strides {x.stride()}")
    one_shot = _ONE_SHOT.get(group)
    if one_shot is not None and one_shot.takes(x):
        return one_shot(x)
    dist.all_reduce(x, group=group)
    return x


class OneShotAllReduce:
    """A group's symmetric bf16 buffer of ``SYMM_MAX_BYTES`` and the one-shot sum over it."""

    def __init__(self, group, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.name)
        self.buffer = symm_mem.empty(SYMM_MAX_BYTES // 2, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(self.buffer, self.name)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.is_contiguous() and x.numel() <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        staged.copy_(flat)  # every rank's copy is read by the others inside the kernel
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.name, flat)
        return x


_ONE_SHOT: dict = {}  # process group -> OneShotAllReduce, for groups set up with one


def min_over_ranks(values: list[int], tp: TPInfo, device: torch.device) -> list[int]:
    """Each value's least over the tensor-parallel ranks (every rank calls it; one rank: as given)."""
    if tp.size == 1 or tp.group is None:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return t.tolist()


def broadcast_from_first(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """``x`` of the first rank, on every rank of ``tp`` (in place; a no-op on one rank)."""
    if tp.size > 1:
        dist.broadcast(x, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension, in rank order."""
    if tp.size == 1:
        return x
    x = x.contiguous()  # and so every part: empty_like keeps a strided input's layout
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
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
        if SYMM_ALL_REDUCE:  # every rank alike: the rendezvous is collective
            _ONE_SHOT[dist.group.WORLD] = OneShotAllReduce(dist.group.WORLD, device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TPInfo(rank=rank, size=size, group=dist.group.WORLD)


def local_threads_for(size: int) -> int:
    """CPU threads per rank so P ranks on one host do not oversubscribe its cores."""
    return max(1, (os.cpu_count() or 1) // size)
