"""Reference MoE for NVFP4 banks in plain PyTorch: dequantise the experts a batch hits, then run
the bf16 reference on them.

Runs on any device and is exact up to the activation dtype (the dequantised weights are what
transformers would run on a dequantised checkpoint), which makes it the oracle for the Triton
W4A16 kernel. It is not fast: it materialises every hit expert, all of them in a long prefill.
"""

from __future__ import annotations

import torch

from ft.moe.kernels.into import Into
from ft.moe.kernels.torch_ref import fused_moe_ref
from ft.quant.nvfp4 import NVFP4Tensor, dequantize


def fused_moe_nvfp4_ref(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_tokens: int | None = None,
    into: Into | None = None,
    batch_experts: int | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 codes [E, 2I, H/2], scales [E, 2I, H/16], globals [E, 2I]; w2 codes
    [E, H, I/2], scales [E, H, I/16], globals [E, H]; weights/ids [T, k] -> [T, H].
    One path and one order at every size, so ``batch_tokens`` and ``batch_experts`` change nothing.
    ``into``: ``fused_moe_ref``'s."""
    e, two_i, half_h = w13.weight.shape
    assert half_h * 2 == x.shape[-1], f"w13 codes {tuple(w13.weight.shape)} do not fit x {tuple(x.shape)}"
    assert w2.weight.shape == (e, x.shape[-1], two_i // 4), (
        f"w2 codes {tuple(w2.weight.shape)} are not [{e}, {x.shape[-1]}, {two_i // 4}]"
    )
    assert w13.weight_scale_2.shape == (e, two_i) and w2.weight_scale_2.shape == (e, x.shape[-1]), (
        "NVFP4 banks carry one global per row"
    )
    hit, local_ids = torch.unique(ids, return_inverse=True)  # [n], [T, k] into hit

    def experts(w: NVFP4Tensor) -> torch.Tensor:
        return dequantize(w.weight[hit], w.weight_scale[hit], w.weight_scale_2[hit], x.dtype)

    return fused_moe_ref(x, experts(w13), experts(w2), weights, local_ids, into=into)
