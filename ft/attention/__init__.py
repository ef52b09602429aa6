"""Attention backends: paged-KV causal GQA attention over a flattened varlen batch.

A backend has ``forward(q, k, v, kv_cache, batch, scale) -> out`` that first writes the new
k/v into the paged cache at ``batch.slot_mapping`` and then attends over each sequence's cached
keys through its block table. The cache is ``[2, num_blocks, block_size, kv_heads, head_dim]``.
"auto" picks the Triton kernels on CUDA when triton imports, the torch reference otherwise.
"""

from __future__ import annotations


def _triton():
    from ft.attention.triton_paged import TritonAttention

    return TritonAttention()


def _torch():
    from ft.attention.torch_ref import TorchAttention

    return TorchAttention()


BACKENDS = {"triton": _triton, "torch": _torch}


def get_attention_backend(name: str, device_type: str):
    if name == "auto":
        if device_type == "cuda":
            try:
                return _triton()
            except ImportError:
                pass
        return _torch()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: auto, {', '.join(BACKENDS)})")
    return BACKENDS[name]()
