"""The per-forward context: the batch's layout and the kernels chosen for it.

The model runner enters ``forward_context(...)`` around one model forward; attention and GDN
layers read the batch metadata from it. Contexts refuse to nest, so a layer can never see the
metadata of another forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ft.gdn.snapshots import StateSnapshots


@dataclass
class ForwardBatch:
    """A flattened batch of B sequences with T tokens in total (prefill chunks and decodes mixed).

    Sequence i owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]``; it had ``context_lens[i]`` tokens
    cached before this step and has ``seq_lens[i]`` after it.
    """

    positions: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past the end
    slot_mapping: torch.Tensor  # [T] int64, KV slot of each new token, -1 for padding
    state_slots: torch.Tensor  # [B] int64, GDN state slot of each sequence
    prev_token_ids: (
        torch.Tensor
    )  # [B, W] int64, the W tokens before each sequence's first new token; -1 before 0
    block_size: int
    # host copies for the reference kernels and for planning; never read inside CUDA graphs
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # GDN states to save partway through sequences this step (ft.gdn.snapshots), eager steps only
    snapshots: StateSnapshots | None = None
    # what a backend derives from the batch once and reuses in every layer (e.g. fla's chunk index)
    derived: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)


@dataclass
class ForwardContext:
    batch: ForwardBatch
    attention: object  # ft.attention backend
    gdn: object  # ft.gdn backend


_CTX: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CTX
    if _CTX is not None:
        raise RuntimeError("forward_context is already active; forwards do not nest")
    _CTX = ctx
    try:
        yield ctx
    finally:
        _CTX = None


def get_forward_context() -> ForwardContext:
    if _CTX is None:
        raise RuntimeError("no forward context: the model runner enters forward_context around a forward")
    return _CTX
