"""How a parameter takes its slice of a checkpoint tensor.

Every parameter carries ``weight_loader(param, ckpt, shard_id)``. The helpers here do the common
cases: a whole tensor (replicated), and rows or columns of one part of a fused tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ft.models.checkpoint import FLOAT_DTYPES, CheckpointTensor


def new_param(*shape: int, dtype: torch.dtype | None = None, loader=None, device=None) -> nn.Parameter:
    """An uninitialised parameter on the build device (or ``device``) that loads with ``loader``."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader or load_whole
    return p


def load_whole(param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
    """A replicated tensor: the checkpoint shape is the parameter shape."""
    ckpt.expect_shape(param.shape)
    ckpt.expect_dtype(FLOAT_DTYPES)
    param.data.copy_(ckpt.read())


def load_slice(
    param: torch.Tensor,
    ckpt: CheckpointTensor,
    *,
    global_shape: Sequence[int],
    dim: int,
    src_start: int,
    dst_start: int,
    length: int,
    src_offset: int = 0,
) -> None:
    """Copy ``length`` entries along ``dim`` from ckpt[src_offset + src_start:] into param[dst_start:]."""
    ckpt.expect_shape(global_shape)
    ckpt.expect_dtype(FLOAT_DTYPES)
    param.data.narrow(dim, dst_start, length).copy_(ckpt.narrow(dim, src_offset + src_start, length))
