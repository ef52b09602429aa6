"""Quantised checkpoint weights read as float: NVFP4 and block-FP8 tensors dequantised as they load.

A checkpoint may store, as NVFP4 or block-FP8, weights that the model keeps in float:

- dense projections (attention, GDN, shared expert, a dense MLP, even a router or lm_head):
  ModelOpt's NVFP4 recipe quantises every linear its ignore patterns leave, Qwen's official FP8
  releases every linear but a few; our dense layers and their kernels are bf16;
- routed experts stored as block-FP8 (Qwen's FP8 releases), for a bf16 bank, or for an NVFP4
  bank that quantises them at load (``--quantize-experts nvfp4``).

The model notes such checkpoint modules at build (``Dequantize`` by module name on
``model.dequantized``, ``ft.quant.dense``), and the loader hands the layer's own weight loader
``Nvfp4Tensor`` / ``Fp8BlockTensor``: the checkpoint tensor as its fp32 dequantisation, computed
on the device of the parameter it loads (only the stored bytes asked for travel there: on a GPU
an 80B block-FP8 checkpoint's dequantisation is not minutes of CPU time). Every
sharding and reordering loader (column parts, row-parallel columns, GDN's key-head groups, vocab
rows, an expert's intermediate slice) reads it as it reads a float tensor, so the model computes
what transformers computes on the dequantised weights, at any tensor-parallel size. NVFP4's
``input_scale`` (W4A4's activation scale) is read and not used, as the experts' is.

Not here: quantised storage or kernels for these weights (their memory is the float one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ft.models.checkpoint import FLOAT_DTYPES, CheckpointError, CheckpointTensor
from ft.quant import nvfp4
from ft.utils import cdiv

# beside ``weight``: what each format stores (the first ones required; NVFP4's input_scale may be absent)
COMPANIONS = {"nvfp4": ("weight_scale", "weight_scale_2", "input_scale"), "fp8_block": ("weight_scale_inv",)}
REQUIRED = {"nvfp4": 2, "fp8_block": 1}


@dataclass(frozen=True)
class Dequantize:
    """How a checkpoint module's weight is stored: ``nvfp4``, or ``fp8_block`` in ``block`` blocks."""

    format: str
    block: tuple[int, int] | None = None


class Nvfp4Tensor(CheckpointTensor):
    """A ``CheckpointTensor`` of shape ``[out, in]``, dtype fp32, over an NVFP4 weight's codes
    (read by rows or by 16-wide column blocks, lazily) and its block scales and global (read
    whole: in/16 bytes a row); dequantised on ``device``."""

    def __init__(
        self,
        codes: CheckpointTensor,
        scale: CheckpointTensor,
        global_scale: CheckpointTensor,
        device: torch.device | str = "cpu",
    ):
        self.name, self.file, self.device = codes.name, codes.file, torch.device(device)
        codes.expect_dtype([torch.uint8])
        if len(codes.shape) != 2:
            raise codes.error(f"shape {list(codes.shape)}: NVFP4 codes are [out, in/2]")
        out, half = codes.shape
        if (2 * half) % nvfp4.BLOCK:
            raise codes.error(f"{2 * half} inputs a row, not a multiple of NVFP4's {nvfp4.BLOCK}-wide blocks")
        scale.expect_dtype([torch.float8_e4m3fn])
        scale.expect_shape((out, 2 * half // nvfp4.BLOCK))
        global_scale.expect_dtype([torch.float32])
        if global_scale.shape not in ((), (1,)):
            raise global_scale.error(f"shape {list(global_scale.shape)}: a weight_scale_2 is one number")
        self._codes, self._scale = codes, _checked_scales(scale)
        self._global = global_scale.read().reshape(())
        if not torch.isfinite(self._global) or self._global < 0:  # 0: an all-zero weight's
            raise global_scale.error(f"value {self._global.item()}: a global scale is finite and >= 0")
        self.shape, self.dtype = (out, 2 * half), torch.float32

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.check_range(dim, start, length)
        if dim == 0:  # the rows alone: a rank's column-parallel share
            return self._dequantize(self._codes.narrow(0, start, length), self._scale[start : start + length])
        # the blocks holding the columns (a row-parallel rank's share), then the columns of those
        block = nvfp4.BLOCK
        first, end = start // block, cdiv(start + length, block)
        codes = self._codes.narrow(1, first * block // 2, (end - first) * block // 2)
        return self._dequantize(codes, self._scale[:, first:end]).narrow(1, start - first * block, length)

    def read(self) -> torch.Tensor:
        return self._dequantize(self._codes.read(), self._scale)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # the stored bytes travel (a byte holds two weights, a scale sixteen), the fp32 is made there
        device = self.device
        return nvfp4.dequantize(codes.to(device), scale.to(device), self._global.to(device))


class Fp8BlockTensor(CheckpointTensor):
    """A ``CheckpointTensor`` of shape ``[out, in]``, dtype fp32, over a block-FP8 weight (read by
    rows or columns, lazily) and its ``weight_scale_inv`` per ``bn × bk`` block (read whole; fp32,
    or bf16 as some releases store it): ``w[r, c] = weight[r, c] · scale_inv[r // bn, c // bk]``,
    computed on ``device``."""

    def __init__(
        self,
        weight: CheckpointTensor,
        scale_inv: CheckpointTensor,
        block: tuple[int, int],
        device: torch.device | str = "cpu",
    ):
        self.name, self.file, self.device = weight.name, weight.file, torch.device(device)
        weight.expect_dtype([torch.float8_e4m3fn])
        if len(weight.shape) != 2:
            raise weight.error(f"shape {list(weight.shape)}: a block-FP8 weight is [out, in]")
        bn, bk = block
        out, inp = weight.shape
        scale_inv.expect_dtype(FLOAT_DTYPES)
        scale_inv.expect_shape((cdiv(out, bn), cdiv(inp, bk)))
        self._weight, self._scale, self._block = weight, _checked_scales(scale_inv).float(), block
        self.shape, self.dtype = (out, inp), torch.float32

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows or columns ``[start, start + length)``, reading only those (a row-parallel rank's
        columns: an expert's down projection under TP)."""
        self.check_range(dim, start, length)
        (bn, bk), device = self._block, self.device
        spans = [(0, n) for n in self.shape]
        spans[dim] = (start, start + length)
        (r0, r1), (c0, c1) = spans
        # the fp8 bytes and the blocks' scales travel; each element's scale is picked out there
        # (expanded here it would be four bytes an element against the weight's one)
        scale = self._scale[r0 // bn : cdiv(r1, bn), c0 // bk : cdiv(c1, bk)].to(device)
        rows = torch.arange(r0, r1, device=device) // bn - r0 // bn
        cols = torch.arange(c0, c1, device=device) // bk - c0 // bk
        weight = self._weight.narrow(dim, start, length).to(device)
        return weight.float() * scale[rows][:, cols]  # [rows, cols]

    def read(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


def _checked_scales(scale: CheckpointTensor) -> torch.Tensor:
    """The scales, read whole; a NaN or negative one is named with its index."""
    values = scale.read()
    bad = ~torch.isfinite(values.float()) | (values.float() < 0)
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise scale.error(f"block scale [{row}, {col}] is {values[row, col].item()}: NaN or negative")
    return values


def companions(module: str, how: Dequantize) -> list[str]:
    """The tensors stored beside ``{module}.weight`` in ``how``'s format."""
    return [f"{module}.{c}" for c in COMPANIONS[how.format]]


def open_dequantized(
    weight: CheckpointTensor,
    module: str,
    how: Dequantize,
    where: dict[str, str],
    tensor: Callable[[str], CheckpointTensor],
    device: torch.device | str = "cpu",
) -> CheckpointTensor:
    """``module``'s weight as float, its scales read from whichever files hold them (``where``:
    tensor name -> file, the checkpoint's headers; ``tensor``: a checkpoint tensor by name, from
    the loader's open files), dequantised on ``device`` as it is read. A weight stored in float
    without any of the format's companions loads as it is: tools read exclusion lists
    differently (ModelOpt's patterns as globs, transformers' ``modules_to_not_convert`` as name
    fragments), so a module the declaration seems to quantise may have been left out; its
    tensors decide."""
    if weight.dtype in FLOAT_DTYPES:
        beside = [c for c in companions(module, how) if c in where]
        if beside:
            raise weight.error(
                f"stored as {weight.dtype} beside {beside[0]!r}: neither float nor {how.format}"
            )
        return weight
    names = companions(module, how)[: REQUIRED[how.format]]
    for name in names:
        if name not in where:
            raise CheckpointError(
                f"missing tensor {name!r}: {module} is declared {how.format} ({weight.file})"
            )
    if how.format == "nvfp4":
        return Nvfp4Tensor(weight, tensor(names[0]), tensor(names[1]), device)
    return Fp8BlockTensor(weight, tensor(names[0]), how.block, device)
