"""The shapes, dtypes and strides the W4A16 paths check NVFP4 banks and their operands for: a
bank's codes, scales and per-row globals (``check_bank``) and a fused MoE call's (``check_operands``,
for ``triton_w4a16``'s MMA path and ``triton_moe_gemv``'s GEMV alike). Not here: the bf16 paths'
checks (``triton_moe.check_operands``), the format itself (``ft.quant.nvfp4``).
"""

from __future__ import annotations

import torch

from ft.quant.nvfp4 import BLOCK, NVFP4Tensor


def check_bank(w: NVFP4Tensor, e: int, n: int, k: int, what: str) -> None:
    assert w.weight.shape == (e, n, k // 2) and w.weight.dtype == torch.uint8, (
        f"{what} codes {tuple(w.weight.shape)} {w.weight.dtype} are not uint8 [{e}, {n}, {k // 2}]"
    )
    assert w.weight_scale.shape == (e, n, k // BLOCK) and w.weight_scale.dtype == torch.float8_e4m3fn, (
        f"{what} scales {tuple(w.weight_scale.shape)} {w.weight_scale.dtype} are not "
        f"float8_e4m3fn [{e}, {n}, {k // BLOCK}]"
    )
    g = w.weight_scale_2
    assert g.shape == (e, n) and g.dtype == torch.float32, (
        f"{what} globals {tuple(g.shape)} {g.dtype} are not fp32 [{e}, {n}] (one per row)"
    )
    assert w.weight.stride(-1) == 1 and w.weight_scale.stride(-1) == 1 and g.stride(-1) == 1, (
        f"{what} codes, scales and globals must be contiguous in their last dim"
    )


def check_operands(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tokens: int | None = None,
) -> tuple[int, int, int]:
    """Shapes and dtypes both W4A16 paths need; returns (E, I, k). ``tokens``: the call's, where
    they are rows of x (``Into``)."""
    t, h = x.shape
    t = t if tokens is None else tokens
    e, two_i = w13.weight.shape[:2]
    inter = two_i // 2
    topk = ids.shape[1]
    assert x.dtype == torch.bfloat16, f"x must be bf16 (W4A16), got {x.dtype}"
    assert h % BLOCK == 0 and inter % BLOCK == 0 and two_i % 2 == 0, (
        f"H={h} and I={inter} must be multiples of {BLOCK}"
    )
    check_bank(w13, e, two_i, h, "w13")
    check_bank(w2, e, h, inter, "w2")
    assert weights.shape == ids.shape == (t, topk), f"weights/ids must be [{t}, k], got {tuple(ids.shape)}"
    return e, inter, topk
