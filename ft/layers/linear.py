"""The tensor-parallel linear family.

- ``ColumnParallelLinear``: output rows split over ranks, part by part for fused projections
  (``output_sizes=[I, I]`` for gate_up); no communication.
- ``QKVParallelLinear``: q split by head; k and v split by head, or replicated when there are
  fewer kv heads than ranks. ``q_head_rows=2*head_dim`` keeps each head's [q_h, gate_h] together.
- ``RowParallelLinear``: input columns split; ``forward`` all-reduces, bias added once after.
  ``partial`` returns this rank's unreduced share, for a block that reduces several sums at once.
- ``ReplicatedLinear``: every rank holds the whole weight.

A fused tensor's parts are loaded separately (``shard_id`` = part index) or, when the checkpoint
stores them fused, all at once (``shard_id=None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ft.distributed import TPInfo, all_reduce, get_tp_info
from ft.layers.loading import load_slice, new_param
from ft.models.checkpoint import CheckpointTensor
from ft.utils import div_even

try:  # decode-sized products on a GPU, when timed faster than cuBLAS (triton_gemv.GEMV_MAX_TOKENS)
    from ft.layers import triton_gemv
except ImportError:  # no triton (CPU-only installs)
    triton_gemv = None


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the Triton GEMV for a few rows on a GPU (``ft.layers.triton_gemv``)."""
    if triton_gemv is not None and bias is None and triton_gemv.takes(x, weight):
        return triton_gemv.gemv(x, weight)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Part:
    """One piece of a dim-0 fused tensor: ``local`` of its ``size`` rows, from ``start``, live here."""

    size: int
    local: int
    start: int


def split_part(size: int, tp: TPInfo, what: str) -> Part:
    local = div_even(size, tp.size, what)
    return Part(size, local, tp.rank * local)


def heads_part(num_heads: int, rows_per_head: int, tp: TPInfo, what: str) -> Part:
    """Whole heads per rank; with fewer heads than ranks each head is replicated on P/heads ranks."""
    if num_heads >= tp.size:
        local = div_even(num_heads, tp.size, what)
        first = tp.rank * local
    else:
        if tp.size % num_heads:  # each head on tp.size / num_heads ranks: it must come out whole
            raise ValueError(
                f"{what}: {num_heads} heads cannot be replicated evenly over {tp.size} tensor-parallel "
                f"ranks (the rank count must be a multiple of the heads when it exceeds them)"
            )
        local, first = 1, tp.rank * num_heads // tp.size
    return Part(num_heads * rows_per_head, local * rows_per_head, first * rows_per_head)


class PartsLoader:
    """Loads a tensor whose dim 0 is the concatenation of ``parts`` (other dims whole)."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = tuple(parts)

    def __call__(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id: int | None) -> None:
        tail = tuple(param.shape[1:])
        ids = range(len(self.parts)) if shard_id is None else [shard_id]
        fused_rows = sum(p.size for p in self.parts)
        for i in ids:
            part = self.parts[i]
            load_slice(
                param,
                ckpt,
                global_shape=(fused_rows if shard_id is None else part.size, *tail),
                dim=0,
                src_offset=sum(p.size for p in self.parts[:i]) if shard_id is None else 0,
                src_start=part.start,
                dst_start=sum(p.local for p in self.parts[:i]),
                length=part.local,
            )


def parts_param(parts: Sequence[Part], *tail: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return new_param(sum(p.local for p in parts), *tail, dtype=dtype, loader=PartsLoader(parts))


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, parts=None) -> None:
        super().__init__()
        self.tp = get_tp_info()
        self.parts = tuple(parts or (split_part(n, self.tp, "column-parallel output") for n in output_sizes))
        self.output_sizes = [p.local for p in self.parts]
        self.weight = parts_param(self.parts, input_size)
        self.bias = parts_param(self.parts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        q_head_rows: int | None = None,
        bias: bool = False,
    ) -> None:
        tp = get_tp_info()
        if num_heads < tp.size:  # before heads_part, which would offer to replicate them as kv heads
            raise ValueError(f"{num_heads} attention heads cannot be split over {tp.size} ranks")
        parts = (
            heads_part(num_heads, q_head_rows or head_dim, tp, "attention heads"),
            heads_part(num_kv_heads, head_dim, tp, "kv heads"),
            heads_part(num_kv_heads, head_dim, tp, "kv heads"),
        )
        super().__init__(hidden_size, (), bias, parts=parts)
        self.num_heads = parts[0].local // (q_head_rows or head_dim)
        self.num_kv_heads = parts[1].local // head_dim


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_info()
        self.input_size, self.output_size = input_size, output_size
        self.local_in = div_even(input_size, self.tp.size, "row-parallel input")
        self.weight = new_param(output_size, self.local_in, loader=self._load)
        self.bias = new_param(output_size) if bias else None

    def _load(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
        load_slice(
            param,
            ckpt,
            global_shape=(self.output_size, self.input_size),
            dim=1,
            src_start=self.tp.rank * self.local_in,
            dst_start=0,
            length=self.local_in,
        )

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product, before the reduce (no bias)."""
        return dense(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' shares summed, plus the bias (for a product computed elsewhere)."""
        y = all_reduce(partial, self.tp)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_param(output_size, input_size)
        self.bias = new_param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)
