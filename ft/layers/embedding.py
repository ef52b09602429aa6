"""Vocab-parallel embedding and lm_head: each rank holds a contiguous range of vocab rows.

The vocabulary is padded up to a multiple of the rank count; padding rows are zero and their
logits are cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ft.distributed import all_gather_last_dim, all_reduce, get_tp_info
from ft.layers.loading import load_slice, new_param
from ft.models.checkpoint import CheckpointTensor
from ft.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    lookup = True  # a token reads one row (``ft.bench.roofline``: not a matmul, not read whole)

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp_info()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.local_vocab = cdiv(vocab_size, self.tp.size)
        self.start = self.tp.rank * self.local_vocab
        self.rows = max(0, min(self.local_vocab, vocab_size - self.start))  # real rows on this rank
        self.weight = new_param(self.local_vocab, hidden_size, loader=self._load)

    def _load(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
        param.data.zero_()
        load_slice(
            param,
            ckpt,
            global_shape=(self.vocab_size, self.hidden_size),
            dim=0,
            src_start=self.start,
            dst_start=0,
            length=self.rows,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary; each rank computes its rows, then they are gathered."""

    lookup = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V]
        logits = F.linear(x, self.weight)
        return all_gather_last_dim(logits, self.tp)[..., : self.vocab_size]
