"""CheckpointTensor: one named tensor of a safetensors file, read lazily and by slice.

Layers receive these in their weight loaders and read only their rank's slice; every check
raises a ``CheckpointError`` that names the tensor and the file it came from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """A checkpoint does not match the model: names the tensor and the file."""


def open_file(file: str):
    """``safe_open`` of ``file``; a truncated, corrupt or unreadable one raises an error naming it
    (safetensors' own names no file)."""
    try:
        return safe_open(file, "pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


class CheckpointTensor:
    def __init__(self, name: str, file: str, handle) -> None:
        self.name = name
        self.file = file
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(self._slice.get_dtype(), self._slice.get_dtype())

    def error(self, why: str) -> CheckpointError:
        return CheckpointError(f"tensor {self.name!r} in {self.file}: {why}")

    def expect_shape(self, shape: Sequence[int]) -> None:
        if tuple(shape) != self.shape:
            raise self.error(f"shape {list(self.shape)}, expected {list(shape)}")

    def expect_dtype(self, allowed: Sequence[torch.dtype]) -> None:
        if self.dtype not in allowed:
            raise self.error(f"dtype {self.dtype}, expected one of {[str(d) for d in allowed]}")

    def check_range(self, dim: int, start: int, length: int) -> None:
        if start < 0 or start + length > self.shape[dim]:
            raise self.error(f"slice [{start}, {start + length}) of dim {dim} is outside {list(self.shape)}")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``[start, start + length)`` along ``dim`` and nothing else."""
        self.check_range(dim, start, length)
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def read(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)] if self.shape else self._slice[()]


class Unread(Exception):
    """Raised by a ``HeaderTensor`` where a weight loader would read data: its checks have passed."""


class HeaderTensor(CheckpointTensor):
    """A ``CheckpointTensor`` whose data is never read: a weight loader handed one runs its checks
    (shape, dtype, the rank's slice) and stops at its first read with ``Unread``."""

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.check_range(dim, start, length)
        raise Unread(self.name)

    def read(self) -> torch.Tensor:
        raise Unread(self.name)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
