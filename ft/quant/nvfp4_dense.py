"""Dense NVFP4 projections, dequantised as they load.

ModelOpt's NVFP4 recipe quantises every linear layer its ignore patterns leave, so a checkpoint
may store attention, GDN and shared-expert projections (a dense MLP, even a router or lm_head)
as NVFP4 beside the routed experts. Our dense layers and their kernels are bf16: such a module
is built as usual, and the loader hands its own weight loader ``DequantizedTensor``, the
checkpoint tensor as ``e2m1(code) · weight_scale · weight_scale_2`` in fp32. Every sharding and
reordering loader (column parts, row-parallel columns, GDN's key-head groups, vocab rows) reads
it as it reads a float tensor, so the model computes what transformers computes on the
dequantised weights, at any tensor-parallel size. ``input_scale`` (W4A4's activation scale) is
read and not used, as the experts' is.

Not here: NVFP4 storage or kernels for dense layers. Their memory is the bf16 one (the dense
weights are a small share of these models' bytes; the experts keep their NVFP4 banks).
"""

from __future__ import annotations

import torch

from ft.models.checkpoint import CheckpointError, CheckpointTensor, open_file
from ft.quant import nvfp4

SCALE, GLOBAL, INPUT_SCALE = "weight_scale", "weight_scale_2", "input_scale"
COMPANIONS = (SCALE, GLOBAL, INPUT_SCALE)  # beside ``weight``; input_scale may be absent
REQUIRED = (SCALE, GLOBAL)


class DequantizedTensor(CheckpointTensor):
    """A ``CheckpointTensor`` of shape ``[out, in]``, dtype fp32, over an NVFP4 weight's codes
    (read by rows, lazily) and its block scales and global (read whole: in/16 bytes a row)."""

    def __init__(self, codes: CheckpointTensor, scale: CheckpointTensor, global_scale: CheckpointTensor):
        self.name, self.file = codes.name, codes.file
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
        self._codes, self._scale = codes, scale.read()
        self._global = global_scale.read().reshape(())
        if not torch.isfinite(self._global) or self._global <= 0:
            raise global_scale.error(f"value {self._global.item()}: a global scale is finite and positive")
        bad = ~torch.isfinite(self._scale.float()) | (self._scale.float() < 0)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            value = self._scale[row, col].item()
            raise scale.error(f"block scale [{row}, {col}] is {value}: NaN or negative")
        self.shape, self.dtype = (out, 2 * half), torch.float32

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.check_range(dim, start, length)
        if dim == 0:  # the rows alone: a rank's column-parallel share
            codes, scale = self._codes.narrow(0, start, length), self._scale[start : start + length]
            return nvfp4.dequantize(codes, scale, self._global)
        return self.read().narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        return nvfp4.dequantize(self._codes.read(), self._scale, self._global)


def companions(module: str) -> list[str]:
    """The tensors beside ``{module}.weight`` that an NVFP4 module stores."""
    return [f"{module}.{c}" for c in COMPANIONS]


def open_dequantized(codes: CheckpointTensor, module: str, where: dict[str, str]) -> DequantizedTensor:
    """``DequantizedTensor`` of ``module``'s codes, its scales read from whichever files hold them
    (``where``: tensor name -> file, the checkpoint's headers)."""
    names = [f"{module}.{c}" for c in REQUIRED]
    for name in names:
        if name not in where:
            raise CheckpointError(f"missing tensor {name!r}: {module} is declared NVFP4 ({codes.file})")
    with open_file(where[names[0]]) as a, open_file(where[names[1]]) as b:
        scale = CheckpointTensor(names[0], where[names[0]], a)
        return DequantizedTensor(codes, scale, CheckpointTensor(names[1], where[names[1]], b))
