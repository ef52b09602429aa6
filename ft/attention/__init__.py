"""Attention backends: paged-KV causal GQA attention over a flattened varlen batch.

A backend has ``forward(q, k, v, kv_cache, batch, scale) -> out`` that first writes the new
k/v into the paged cache at ``batch.slot_mapping`` and then attends over each sequence's cached
keys through its block table. The cache is ``[2, num_blocks, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations


def get_attention_backend(name: str, device_type: str):
    if name == "auto":
        name = "torch"
    if name == "torch":
        from ft.attention.torch_ref import TorchAttention

        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (known: torch)")
