"""Reference paged attention in plain PyTorch: one sequence at a time, fp32 softmax.

Exact and slow; it is the oracle for the GPU kernels and the path on CPU. Given the layer's
``QKNormGate`` it keeps the Triton backend's contract by composition (norms and rope, then the
cache write and attention, then the gate); it fuses nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ft.forward_context import ForwardBatch

if TYPE_CHECKING:
    from ft.layers.attention import QKNormGate


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new k/v [T, Hkv, d] at flat slots [T] of the cache; slot -1 marks padding."""
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    hkv, d = kv_cache.shape[-2:]
    kv_cache[0].view(-1, hkv, d)[slots] = k.to(kv_cache.dtype)
    kv_cache[1].view(-1, hkv, d)[slots] = v.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` cached keys and values of one sequence: [length, Hkv, d] each."""
    bs = kv_cache.shape[2]
    blocks = block_table[: -(-length // bs)].long()
    hkv, d = kv_cache.shape[-2:]
    k = kv_cache[0, blocks].reshape(-1, hkv, d)[:length]
    v = kv_cache[1, blocks].reshape(-1, hkv, d)[:length]
    return k, v


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Tq, Hq, d] at positions start.., k/v [Tk, Hkv, d]; ``allowed`` [Tq, Tk] narrows the mask."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    qpos = torch.arange(start, start + tq, device=q.device)[:, None]
    mask = torch.arange(tk, device=q.device)[None, :] <= qpos  # [Tq, Tk]
    if allowed is not None:
        mask = mask & allowed
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


class TorchAttention:
    name = "torch"

    def forward(
        self, q, k, v, kv_cache, batch: ForwardBatch, scale: float, around: QKNormGate | None = None
    ) -> torch.Tensor:
        if around is not None:
            q, k = around.norm_rope(q, k)
            return around.apply_gate(self.forward(q, k, v, kv_cache, batch, scale))
        write_kv(kv_cache, k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            keys, values = gather_kv(kv_cache, batch.block_tables[i], ctx + qlen)
            out[start : start + qlen] = causal_attention(q[start : start + qlen], keys, values, ctx, scale)
            start += qlen
        return out
