"""Small arithmetic helpers whose failures say which numbers were wrong."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def div_even(a: int, b: int, what: str = "value") -> int:
    """a // b, refusing a remainder: sharding never silently drops rows."""
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: through pinned memory on CUDA (a pageable
    copy would wait for the stream). The caching host allocator keeps the pinned buffer until the
    copy has run."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def upload_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a stream sync: made pinned on CUDA, copied
    asynchronously."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def upload_lists(
    fields: list[tuple[Sequence[int] | np.ndarray, torch.dtype, tuple[int, ...]]], device: torch.device
) -> list[torch.Tensor]:
    """Host lists or arrays on ``device`` in one ``upload`` per dtype instead of one synchronous
    copy each: ``(values, dtype, shape)`` -> a contiguous view of that shape into the uploaded
    buffer."""
    flat: dict[torch.dtype, list[np.ndarray]] = {}
    for values, dtype, shape in fields:
        a = np.asarray(values, dtype=_NUMPY[dtype]).reshape(-1)
        assert a.size == math.prod(shape), f"{a.size} values do not fill a {shape} tensor"
        flat.setdefault(dtype, []).append(a)
    buffers = {dt: upload(torch.from_numpy(np.concatenate(parts)), device) for dt, parts in flat.items()}
    offsets = dict.fromkeys(buffers, 0)
    out = []
    for _, dtype, shape in fields:
        start, n = offsets[dtype], math.prod(shape)
        offsets[dtype] = start + n
        out.append(buffers[dtype][start : start + n].view(shape))
    return out


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
