"""The W4A16 MMA kernel (``triton_w4a16``, the GEMV off) under Triton's interpreter, bf16 dots
made exact (``exact_bf16_dots``): against the NVFP4 torch reference with the byte decode and with
the table decode's input order (``LUT``, whose PTX the interpreter replaces by Triton
arithmetic), over several row blocks of pairs, column tails and a K tail; and
``w4a16_dequantize.dequantize_bank``."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER


def check_mma(lut: bool) -> None:
    from ft.moe.kernels import triton_w4a16
    from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref
    from tests.interpreter import exact_bf16_dots
    from tests.nvfp4.test_w4a16_gpu import random_bank

    exact_bf16_dots()
    triton_w4a16.GEMV_MAX_TOKENS = 0  # the MMA path at every size
    triton_w4a16.LUT = lut
    gen = torch.Generator().manual_seed(3)
    # (tokens, experts, H, I, top-k): I=48 leaves a K tail in down (BLOCK_K 64) and column tails
    for t, e, h, inter, k in ((20, 8, 128, 64, 3), (70, 6, 64, 48, 2)):
        x = torch.randn(t, h, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen)
        w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
        got = triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids).float()
        want = fused_moe_nvfp4_ref(x.float(), w13, w2, weights, ids)
        err = ((got - want).norm() / want.norm()).item()
        if not err < 1e-2:  # raised, not asserted: the check runs under -O
            raise AssertionError(f"lut {lut}, T={t}: relative error {err:.3g}")


def check_mma_bytes() -> None:
    check_mma(lut=False)


def check_mma_lut() -> None:
    """``LUT``'s inputs order and values (its Triton twin of the PTX decode)."""
    check_mma(lut=True)


@pytest.mark.parametrize("check", ["check_mma_bytes", "check_mma_lut"])
def test_w4a16_mma_under_the_interpreter(check):
    # under -O: the wrapper asserts CUDA tensors
    run_check("tests.nvfp4.test_w4a16_interp", check, optimize=True)


def check_dequantize_bank() -> None:
    """``dequantize_bank`` against ``nvfp4.dequantize``: each value one of the two bf16 neighbours
    of the reference's fp32 value (the interpreter's fp32 -> bf16 conversion truncates where the
    GPU rounds to nearest; the GPU test asks for the same bits), over row and input tails, several
    experts, rows with globals of their own."""
    from ft.moe.kernels.w4a16_dequantize import dequantize_bank
    from ft.quant.nvfp4 import dequantize
    from tests.nvfp4.test_w4a16_gpu import random_bank

    gen = torch.Generator().manual_seed(4)
    for e, n, k, block in ((3, 40, 96, (16, 64)), (2, 64, 128, (64, 256))):
        w = random_bank(e, n, k, gen)
        got = dequantize_bank(w, block=block).float()
        want = dequantize(w.weight, w.weight_scale, w.weight_scale_2, torch.float32)
        bits, got_bits = want.view(torch.int32), got.view(torch.int32)
        toward_zero = bits & ~0xFFFF  # the bf16 neighbour nearer zero; the other is one step out
        exact = (bits & 0xFFFF) == 0
        ok = (got_bits == toward_zero) | (~exact & (got_bits == toward_zero + 0x10000))
        if not ok.all():
            raise AssertionError(f"{(~ok).sum()} values off (E={e} N={n} K={k})")


def test_dequantize_bank_under_the_interpreter():
    run_check("tests.nvfp4.test_w4a16_interp", "check_dequantize_bank")
