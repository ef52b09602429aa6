"""Attention backends: paged-KV causal GQA attention over a flattened varlen batch.

A backend has ``forward(q, k, v, kv_cache, batch, scale, around=None) -> out`` that first writes
the new k/v into the paged cache at ``batch.slot_mapping`` and then attends over each sequence's
cached keys through its block table. The cache is ``[2, num_blocks, block_size, kv_heads,
head_dim]``. With ``around`` (``ft.layers.attention.QKNormGate``) q and k are the projection's raw
heads, normed and rotated before anything else, and the output is gated: the reference composes
these steps, the Triton backend fuses them into a decode step's kernels (``FUSED_DECODE``).
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
