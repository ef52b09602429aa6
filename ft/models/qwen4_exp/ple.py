"""PLE: hashed n-gram per-layer embeddings (spec section 7).

For PLE layer u, n-gram order index o (order N) and head j, token t reads one row of a shared
table, addressed by its last N token ids alone:

    mix = XOR_{i<N} tok(t-i) · multipliers[u, o, i]      # int64, wrapping; ple_pad_id before 0
    row = offset[u, o, j] + (mix mod primes[u, o, j])     # offset: running sum of the primes
    e_t = concat_{o, j} table[row]                         # [De]
    PLE_u(x_t) = sigmoid(<key_norm(key_proj e_t), query_norm(x_t)> / sqrt(H)) · value_proj e_t

``PLETable`` computes the row ids for every PLE layer of a step and gathers them; the tokens
before a chunk come from ``ForwardBatch.prev_token_ids`` (-1 before position 0), so prefill
chunks and decode steps need no other state. The lookup is a gather by row id, so the table can
later live in pinned host memory with the rows copied ahead of the layers. Replicated on every
rank. ``PLELayer`` is the per-layer gate and projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ft.forward_context import ForwardBatch
from ft.layers.linear import ReplicatedLinear
from ft.layers.loading import new_param
from ft.layers.norm import RMSNorm
from ft.models.checkpoint import CheckpointTensor
from ft.models.config import ModelConfig


def load_int64(param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
    ckpt.expect_shape(param.shape)
    ckpt.expect_dtype([torch.int64])
    param.data.copy_(ckpt.read())


class PLETable(nn.Module):
    lookup = True  # a token reads a few rows (``ft.bench.roofline``: not a matmul, not read whole)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        u, o, heads = len(cfg.ple_layers), len(cfg.ple_ngram_orders), cfg.ple_heads
        self.orders, self.pad_id = cfg.ple_ngram_orders, cfg.ple_pad_id
        self.on_host = cfg.ple_on_host
        self.table = new_param(cfg.ple_table_rows, cfg.ple_head_dim, device="cpu" if self.on_host else None)
        self._staging: torch.Tensor | None = None  # pinned host buffer for the rows of one step
        self._registered = False
        self.multipliers = new_param(u, o, max(self.orders), dtype=torch.int64, loader=load_int64)
        self.primes = new_param(u, o, heads, dtype=torch.int64, loader=self._load_primes)
        # uses[i, o]: the i-th token back is part of order o's n-gram
        uses = torch.tensor([[i < n for n in self.orders] for i in range(max(self.orders))])
        self.register_buffer("uses", uses, persistent=False)
        with torch.no_grad():  # generated-weight runs keep these; a checkpoint overwrites them
            self.primes.fill_(max(1, cfg.ple_table_rows // (u * o * heads)))
            self.multipliers.copy_(2 * torch.arange(self.multipliers.numel()).view_as(self.multipliers) + 1)

    def _load_primes(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
        load_int64(param, ckpt)
        rows = int(param.sum())
        if rows != self.table.shape[0] or not bool((param > 0).all()):
            raise ckpt.error(
                f"primes must be positive and sum to the table's {self.table.shape[0]} rows, got {rows}"
            )

    def row_ids(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Table rows [T, U, O, heads] for the flattened batch's tokens."""
        t, width = input_ids.shape[0], batch.prev_token_ids.shape[1]
        lens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(len(lens), device=input_ids.device), lens, output_size=t)
        flat = torch.arange(t, device=input_ids.device)
        local = flat - batch.cu_seqlens[seq].long()  # index within this step's chunk
        mix = torch.zeros(t, *self.primes.shape[:2], dtype=torch.int64, device=input_ids.device)
        for i in range(max(self.orders)):
            back = local - i  # < 0: the token lies before the chunk
            tok = torch.where(
                back >= 0,
                input_ids[(flat - i).clamp(min=0)],
                batch.prev_token_ids[seq, (width + back).clamp(0, width - 1)],
            )
            tok = torch.where(tok < 0, self.pad_id, tok)  # before position 0
            mix ^= torch.where(self.uses[i], tok[:, None, None] * self.multipliers[:, :, i], 0)
        flat_primes = self.primes.reshape(-1)
        offsets = (flat_primes.cumsum(0) - flat_primes).view_as(self.primes)
        return offsets + torch.remainder(mix[..., None], self.primes)  # [T, U, O, heads]

    @property
    def graph_safe(self) -> bool:
        return not self.on_host  # the host gather waits for this step's row ids

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Each PLE layer's embeddings e [U, T, De], De in (order, head) order."""
        rows = self.row_ids(input_ids, batch)
        t, u = rows.shape[:2]
        e = self._gather_host(rows) if self.on_host else F.embedding(rows, self.table)
        return e.reshape(t, u, -1).transpose(0, 1)

    def _gather_host(self, rows: torch.Tensor) -> torch.Tensor:
        """--ple-backend pinned: gather the step's rows from the host table into a pinned staging
        buffer, then copy them to the device asynchronously, before any layer needs them."""
        gathered_shape = (*rows.shape, self.table.shape[1])
        if not rows.is_cuda:
            return F.embedding(rows, self.table)
        if not self._registered:  # page-lock the table in place: no second copy, no rounding up
            self._registered = True
            nbytes = self.table.numel() * self.table.element_size()
            torch.cuda.cudart().cudaHostRegister(self.table.data_ptr(), nbytes, 0)
        need = rows.numel() * self.table.shape[1]
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(max(need, 1 << 20), dtype=self.table.dtype).pin_memory()
        # reusing the buffer is safe: .cpu() above waited for the stream, so last step's copy is done
        staging = self._staging[:need].view(gathered_shape)
        torch.index_select(self.table, 0, rows.reshape(-1).cpu(), out=staging.view(-1, self.table.shape[1]))
        return staging.to(rows.device, non_blocking=True)


class PLELayer(nn.Module):
    def __init__(self, hidden_size: int, embed_dim: int, eps: float) -> None:
        super().__init__()
        self.scale = hidden_size**-0.5
        self.key_proj = ReplicatedLinear(embed_dim, hidden_size)
        self.value_proj = ReplicatedLinear(embed_dim, hidden_size)
        self.key_norm = RMSNorm(hidden_size, eps, zero_centered=True)
        self.query_norm = RMSNorm(hidden_size, eps, zero_centered=True)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x [T, H], e [T, De] -> PLE(x) [T, H]."""
        key = self.key_norm(self.key_proj(e)).float()
        s = (key * self.query_norm(x).float()).sum(-1, keepdim=True) * self.scale  # [T, 1]
        return (torch.sigmoid(s) * self.value_proj(e).float()).to(x.dtype)
