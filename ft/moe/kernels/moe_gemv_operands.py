"""The MoE GEMV's operands as its kernels take them, for ``triton_moe_gemv``'s launcher: a bank's
(codes or weights, scale bytes, globals) and their strides (``bank``, ``strides``), the offload
backend's host store beside its slots, checked to share their layout (``host_operands``), whether
NVFP4 codes can be read as words (``word_aligned``). Not here: the operand checks, tiles and
launches (``triton_moe_gemv``), the kernels (``moe_gemv_kernels``).
"""

from __future__ import annotations

import torch

from ft.quant.nvfp4 import NVFP4Tensor


def word_aligned(*codes: torch.Tensor, size: int = 4) -> bool:
    """Whether NVFP4 code tensors [E, N, K/2] (slots, and a host store beside them) can be read as
    words of ``size`` bytes: their start and row strides multiples of it (else the kernels read
    bytes)."""
    return all(
        c.data_ptr() % size == 0 and c.stride(0) % size == 0 and c.stride(1) % size == 0 for c in codes
    )


def bank(w) -> tuple:
    """(codes or weights, scale bytes, globals, FP4) with the strides the kernels take."""
    if isinstance(w, NVFP4Tensor):
        return w.weight, w.weight_scale.view(torch.uint8), w.weight_scale_2, True
    return w, w, w, False  # bf16: scale and global pointers are never read


def named_strides(b, scale, glob) -> dict:
    """The kernels' stride arguments of a bank's (codes or weights, scales, globals)."""
    return dict(
        s_be=b.stride(0), s_bn=b.stride(1), s_se=scale.stride(0), s_sn=scale.stride(1), s_ge=glob.stride(0)
    )


def host_operands(w, host) -> tuple:
    """The host store's (codes or weights, scales, globals) beside a slot tensor ``w``: same
    layout, so the kernel indexes both with one set of strides."""
    b, scale, glob, _ = bank(w)
    hb, hscale, hglob, _ = bank(host)
    for dev, hst in ((b, hb), (scale, hscale), (glob, hglob)):
        assert dev.dtype == hst.dtype and dev.shape[1:] == hst.shape[1:] and dev.stride() == hst.stride(), (
            f"host store {hst.dtype} {tuple(hst.shape)} strides {hst.stride()} is not laid out as the "
            f"slots ({dev.dtype} {tuple(dev.shape)} strides {dev.stride()})"
        )
    return hb, hscale, hglob
