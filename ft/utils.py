"""Small arithmetic helpers whose failures say which numbers were wrong."""

from __future__ import annotations

import math

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


def upload_lists(
    fields: list[tuple[list, torch.dtype, tuple[int, ...]]], device: torch.device
) -> list[torch.Tensor]:
    """Host lists on ``device`` in one ``upload`` per dtype instead of one synchronous copy each:
    ``(flat values, dtype, shape)`` -> a contiguous view of that shape into the uploaded buffer."""
    flat: dict[torch.dtype, list] = {}
    for values, dtype, shape in fields:
        assert len(values) == math.prod(shape), f"{len(values)} values do not fill a {shape} tensor"
        flat.setdefault(dtype, []).extend(values)
    buffers = {dtype: upload(torch.tensor(v, dtype=dtype), device) for dtype, v in flat.items()}
    offsets = dict.fromkeys(buffers, 0)
    out = []
    for values, dtype, shape in fields:
        start = offsets[dtype]
        offsets[dtype] = start + len(values)
        out.append(buffers[dtype][start : start + len(values)].view(shape))
    return out
