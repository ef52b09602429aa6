"""QSA: query-selected sparse attention (spec section 5), the full-attention layer of qwen4_exp.

It is Qwen3-Next's output-gated QK-normed attention (``QKNormAttention``) whose queries read only
some blocks of ``B`` positions. A small replicated indexer scores the complete blocks for each
query:

    qI[t, j] = q_proj(x_t)[j]      kI[s] = k_norm(k_proj x_s)      w[t, j] = w_proj(x_t)[j] / sqrt(Hi·di)
    score[t, b] = sum_j w[t, j] · relu(qI[t, j] · mean_{s in b} kI[s])      (complete blocks b only)

and query t in block c = t // B reads block 0, its local window c-Lc+1 .. c, and the K best
other blocks b < c (ties to the lower index). Every head of every rank uses that one selection:
the indexer's weights and input are replicated, so every rank computes the same scores.

Caches: k/v per kv head in the paged KV cache; kI per token in a paged cache of its own
(``index_keys``, declared through ``extra_paged_caches``), from which block means are taken over
the complete blocks only. Not here: the attention arithmetic (``ft.attention.qsa_torch``).
"""

from __future__ import annotations

import torch
from torch import nn

from ft.attention.qsa_torch import block_sparse_attention
from ft.forward_context import ForwardBatch, get_forward_context
from ft.layers.attention import QKNormAttention, QKNormGate
from ft.layers.linear import ReplicatedLinear
from ft.layers.norm import RMSNorm
from ft.models.config import ModelConfig


def select_blocks(
    scores: torch.Tensor, query_blocks: torch.Tensor, num_blocks: int, local: int, topk: int
) -> torch.Tensor:
    """The blocks each query reads: [Tq, num_blocks] bool.

    ``scores`` [Tq, nc] are the indexer scores over the nc complete blocks (nc >= every query's
    block index c), ``query_blocks`` [Tq] the queries' blocks c.
    """
    tq, nc = scores.shape
    b = torch.arange(num_blocks, device=scores.device)[None, :]  # [1, nb]
    c = query_blocks[:, None]  # [Tq, 1]
    fixed = (b == 0) | ((b > c - local) & (b <= c))
    candidate = (b < c) & ~fixed
    padded = torch.full((tq, num_blocks), float("-inf"), dtype=torch.float32, device=scores.device)
    padded[:, :nc] = scores.float()
    padded = padded.masked_fill(~candidate, float("-inf"))
    # stable descending sort: equal scores keep index order, so ties go to the lower block
    order = torch.sort(padded, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, b.expand(tq, -1).contiguous())
    return fixed | (candidate & (rank < topk))


class QSAIndexer(nn.Module):
    """Scores blocks of keys for each query; replicated on every rank."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = ReplicatedLinear(hidden_size, heads * head_dim)
        self.k_proj = ReplicatedLinear(hidden_size, head_dim)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered=True)
        self.w_proj = ReplicatedLinear(hidden_size, heads)

    def select(
        self,
        x: torch.Tensor,
        index_keys: torch.Tensor,
        batch: ForwardBatch,
        block_size: int,
        local: int,
        topk: int,
    ) -> list[torch.Tensor]:
        """Store this step's kI, then return each sequence's block selection [Tq, nblocks]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim).float()  # [T, Hi, di]
        w = self.w_proj(x).float() * (self.heads * self.head_dim) ** -0.5  # [T, Hi]
        k = self.k_norm(self.k_proj(x))  # [T, di]
        flat = index_keys.view(-1, self.head_dim)
        keep = batch.slot_mapping >= 0
        flat[batch.slot_mapping[keep]] = k[keep].to(index_keys.dtype)
        page = index_keys.shape[1]
        masks, start = [], 0
        for i, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            length = ctx + qlen
            complete = length // block_size
            pages = batch.block_tables[i][: -(-length // page)].long()
            keys = index_keys[pages].reshape(-1, self.head_dim)[: complete * block_size].float()
            kbar = keys.view(complete, block_size, self.head_dim).mean(1)  # [nc, di]
            rows = slice(start, start + qlen)
            dots = torch.einsum("tjd,bd->tjb", q[rows], kbar).relu()  # [Tq, Hi, nc]
            scores = torch.einsum("tj,tjb->tb", w[rows], dots)  # [Tq, nc]
            blocks = batch.positions[rows] // block_size
            masks.append(select_blocks(scores, blocks, -(-length // block_size), local, topk))
            start += qlen
        return masks


class QSAAttention(QKNormAttention):
    # the selection reads host-side sequence lengths and the torch reference attention loops over
    # sequences: a decode step with QSA layers cannot be captured in a CUDA graph yet
    graph_safe = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rotary_dim,
            cfg.rope_theta,
            cfg.rms_norm_eps,
            zero_centered_norm=True,
            output_gate=True,
        )
        self.indexer = QSAIndexer(
            cfg.hidden_size, cfg.qsa_index_heads, cfg.qsa_index_head_dim, cfg.rms_norm_eps
        )
        self.block_size, self.local_blocks, self.topk = (
            cfg.qsa_block_size,
            cfg.qsa_local_blocks,
            cfg.qsa_topk_blocks,
        )
        self.index_keys: torch.Tensor | None = None  # [blocks, page, di], bound by the runner

    def extra_paged_caches(self) -> dict[str, tuple[int, ...]]:
        return {"index_keys": (self.indexer.head_dim,)}

    @property
    def max_keys(self) -> int:
        """The keys a query attends at most: block 0, its local blocks and the selected ones (the
        prefill roofline, ``ft.bench.roofline``)."""
        return (1 + self.local_blocks + self.topk) * self.block_size

    def decode_cache_reads(self, context: int) -> int:
        """At most ``max_keys`` keys and values, and one mean indexer key per complete block (what
        the scores need; this engine still reads every token's kI to take the means)."""
        h, d = self.cache_shape()
        blocks = context // self.block_size
        return 2 * h * d * min(context, self.max_keys) + blocks * self.indexer.head_dim

    def attend(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, around: QKNormGate
    ) -> torch.Tensor:
        batch = get_forward_context().batch
        masks = self.indexer.select(x, self.index_keys, batch, self.block_size, self.local_blocks, self.topk)
        q, k = around.norm_rope(q, k)
        out = block_sparse_attention(q, k, v, self.kv_cache, batch, self.scale, masks, self.block_size)
        return around.apply_gate(out)
