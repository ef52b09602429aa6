"""Block-sparse paged attention in plain PyTorch, for qwen4_exp's QSA layers.

The same contract as ``torch_ref.TorchAttention`` plus a key selection: the new k/v are written
to the paged cache at ``batch.slot_mapping``, then each query attends causally over those cached
keys whose QSA block (``position // qsa_block_size``) its row of ``block_masks`` selects. Which
blocks are selected is the model's business (``ft.models.qwen4_exp.qsa``); this file only
applies a selection. Exact and slow: the CPU path and the oracle for a future GPU kernel.
"""

from __future__ import annotations

import torch

from ft.attention.torch_ref import causal_attention, gather_kv, write_kv
from ft.forward_context import ForwardBatch


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    block_masks: list[torch.Tensor],
    qsa_block_size: int,
) -> torch.Tensor:
    """q [T, Hq, d], k/v [T, Hkv, d]; ``block_masks[i]`` [Tq_i, nblocks_i] bool for sequence i."""
    assert len(block_masks) == batch.num_seqs, f"{len(block_masks)} masks for {batch.num_seqs} sequences"
    write_kv(kv_cache, k, v, batch.slot_mapping)
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
        length = ctx + qlen
        mask = block_masks[i]
        assert mask.shape == (qlen, -(-length // qsa_block_size)), (
            f"sequence {i}: block mask {tuple(mask.shape)} for {qlen} queries over {length} keys"
        )
        allowed = mask.repeat_interleave(qsa_block_size, dim=1)[:, :length]  # [Tq, Tk]
        keys, values = gather_kv(kv_cache, batch.block_tables[i], length)
        out[start : start + qlen] = causal_attention(
            q[start : start + qlen], keys, values, ctx, scale, allowed
        )
        start += qlen
    return out
