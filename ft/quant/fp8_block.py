"""Block-FP8 dense linears: ``weight`` float8_e4m3fn with ``weight_scale_inv`` fp32 per block.

The checkpoint format (DeepSeek-V3 / Qwen FP8 style, ``quant_method: "fp8"``,
``weight_block_size: [bn, bk]``, usually [128, 128]) is

    weight            float8_e4m3fn [out, in]
    weight_scale_inv  fp32          [ceil(out / bn), ceil(in / bk)]
    w[r, c] = weight[r, c] · weight_scale_inv[r // bn, c // bk]

A rank holds its rows (column-parallel, part by part for fused projections) or its columns
(row-parallel) of ``weight``, and for each local row the scales of the k-blocks its columns
touch: ``weight_scale_inv`` is stored [rows_local, kblocks_local], one scale row per weight row.
That costs 4/bk bytes per weight byte (3 % at bk=128) and makes every split exact: a rank
boundary inside a 128-row block (GDN's b/a parts at TP=2, small heads) or a 128-column block
(row-parallel input) reads the same scales as the whole tensor would. ``forward`` dequantises
and runs a float matmul: the reference path, correct on every device, not a fast GPU kernel.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ft.distributed import all_reduce, get_tp_info
from ft.layers.linear import Part, parts_param, split_part
from ft.layers.loading import new_param
from ft.models.checkpoint import CheckpointTensor
from ft.utils import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Checkpoint layout -> dense ``[out, in]`` in ``dtype`` (products taken in float64)."""
    bn, bk = block
    out, inp = weight.shape
    assert scale_inv.shape == (cdiv(out, bn), cdiv(inp, bk)), (
        f"weight_scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} "
        f"in {bn}x{bk} blocks"
    )
    s = scale_inv.double().repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp]
    return (weight.double() * s).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[out, in]`` -> (weight fp8, weight_scale_inv fp32): each block's amax maps to 448."""
    bn, bk = block
    out, inp = w.shape
    padded = torch.zeros(cdiv(out, bn) * bn, cdiv(inp, bk) * bk, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    blocks = padded.view(cdiv(out, bn), bn, cdiv(inp, bk), bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [out/bn, in/bk]
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(padded.shape)[:out, :inp].contiguous(), scale.float()


class Fp8BlockLinear(nn.Module):
    """Rows ``row_parts`` (dim-0 parts of a fused tensor) by columns ``cols`` of a block-FP8 weight."""

    def __init__(self, row_parts: Sequence[Part], cols: Part, block: Sequence[int], bias: bool) -> None:
        super().__init__()
        self.row_parts, self.cols, self.block = tuple(row_parts), cols, tuple(block)
        bn, bk = self.block
        rows = sum(p.local for p in self.row_parts)
        self.first_kblock = cols.start // bk
        kblocks = cdiv(cols.start + cols.local, bk) - self.first_kblock
        self.weight = new_param(rows, cols.local, dtype=FP8, loader=self._load_weight)
        self.weight_scale_inv = new_param(rows, kblocks, dtype=torch.float32, loader=self._load_scale)
        k_block = (cols.start + torch.arange(cols.local)) // bk - self.first_kblock
        self.register_buffer("k_block", k_block, persistent=False)  # [cols_local] local k-block per column
        self.bias = parts_param(self.row_parts) if bias else None

    def _segments(self, shard_id: int | None) -> tuple[int, Iterator[tuple[int, int, int]]]:
        """(rows of the checkpoint tensor, [(first source row, first local row, rows)])."""
        parts = self.row_parts
        ids = range(len(parts)) if shard_id is None else [shard_id]
        total = sum(p.size for p in parts) if shard_id is None else parts[shard_id].size

        def gen():
            for i in ids:
                offset = sum(p.size for p in parts[:i]) if shard_id is None else 0
                yield offset + parts[i].start, sum(p.local for p in parts[:i]), parts[i].local

        return total, gen()

    def _load_weight(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id: int | None) -> None:
        total, segments = self._segments(shard_id)
        c = self.cols
        ckpt.expect_shape((total, c.size))
        ckpt.expect_dtype([FP8])
        whole_cols = c.local == c.size
        for src, dst, n in segments:
            rows = ckpt.narrow(0, src, n) if whole_cols else ckpt.narrow(1, c.start, c.local)[src : src + n]
            param.data[dst : dst + n].copy_(rows)

    def _load_scale(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id: int | None) -> None:
        total, segments = self._segments(shard_id)
        bn, bk = self.block
        ckpt.expect_shape((cdiv(total, bn), cdiv(self.cols.size, bk)))
        ckpt.expect_dtype([torch.float32])
        scales = ckpt.read()[:, self.first_kblock : self.first_kblock + param.shape[1]]  # small: read whole
        for src, dst, n in segments:
            param.data[dst : dst + n].copy_(scales[torch.arange(src, src + n) // bn])

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's weight ``[rows_local, cols_local]`` in ``dtype``."""
        return (self.weight.float() * self.weight_scale_inv[:, self.k_block]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)


class Fp8BlockColumnParallelLinear(Fp8BlockLinear):
    """Output rows split part by part (the parts of a ``ColumnParallelLinear``); no communication.
    With parts that each keep all their rows it is a replicated linear."""

    def __init__(
        self, input_size: int, parts: Sequence[Part], block: Sequence[int], bias: bool = False
    ) -> None:
        super().__init__(parts, Part(input_size, input_size, 0), block, bias)
        self.parts = self.row_parts
        self.output_sizes = [p.local for p in self.parts]


class Fp8BlockRowParallelLinear(Fp8BlockLinear):
    """Input columns split; ``forward`` all-reduces, bias added once after the reduce."""

    def __init__(self, input_size: int, output_size: int, block: Sequence[int], bias: bool = False) -> None:
        tp = get_tp_info()
        cols = split_part(input_size, tp, "row-parallel input")
        super().__init__([Part(output_size, output_size, 0)], cols, block, bias=False)
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.bias = new_param(output_size) if bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product, before the reduce (no bias)."""
        return F.linear(x, self.dequantized(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.partial(x), self.tp)
        return y if self.bias is None else y + self.bias
