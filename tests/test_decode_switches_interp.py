"""Kernel variants behind decode switches (off until timed on a GPU) against the paths they
replace, run by Triton's interpreter on CPU tensors.

Skipped without triton (CI has it). The interpreter is chosen when a kernel is
decorated, so each check runs in a process of its own with ``TRITON_INTERPRET=1`` (``run_check``),
under ``python -O`` because the wrappers assert CUDA tensors (so the checks raise explicitly
instead of asserting).
Exact rounding is checked in fp16 and fp32 (the interpreter truncates to bf16).
``tests/gpu/test_gdn_decode.py`` and ``tests/gpu/test_moe_gemv.py`` check the compiled kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def check_conv_decode_one_launch() -> None:
    """A decode batch's conv in one launch (``DECODE_ONE_LAUNCH``) equals the two launches bit
    for bit, output and history, and the torch reference: sequences with and without context,
    slots out of order, a channel count that is not a multiple of the tile."""
    from ft.gdn import triton_conv
    from ft.gdn.torch_ref import TorchGDN
    from tests.gpu.test_kernels import make_batch

    c, kc, slots = 300, 4, [3, 0, 5, 2]
    batch, _ = make_batch([(5, 1), (0, 1), (17, 1), (2, 1)], 16, device="cpu", state_slots=slots)
    for dtype in (torch.float16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, c, generator=gen).to(dtype)
        weight = torch.randn(c, kc, generator=gen).to(dtype)
        state = torch.randn(8, c, kc - 1, generator=gen).to(dtype)
        results = []
        for one in (False, True):
            triton_conv.DECODE_ONE_LAUNCH = one
            st = state.clone()
            results.append((triton_conv.causal_conv1d_silu(x, weight, st, batch, 1), st))
        (two_out, two_state), (one_out, one_state) = results
        require(torch.equal(one_out, two_out), f"{dtype}: outputs differ")
        require(torch.equal(one_state, two_state), f"{dtype}: histories differ")
        untouched = [s for s in range(8) if s not in slots]
        require(torch.equal(one_state[untouched], state[untouched]), f"{dtype}: other slots changed")
        ref_state = state.clone()
        ref = TorchGDN().conv(x, weight, ref_state, batch)
        require(torch.equal(one_state, ref_state), f"{dtype}: history differs from the reference")
        err = (one_out.float() - ref.float()).abs().max().item()
        bound = 1e-2 if dtype == torch.float16 else 1e-5
        require(err < bound, f"{dtype}: output off the reference by {err}")


def check_moe_gemv_down_order() -> None:
    """The down kernel's programs (one per token, row block and pair) in any order give the same
    bits: the last of a row block sums the pairs' rounded terms in pair order, whichever finishes
    last. fp16 and NVFP4 banks, k = 0 (the shared term alone), 1, 3 and 10, I over one K chunk and
    over several, with and without a shared expert, H over several row blocks, each launch's
    programs in two random orders; every ticket counter is back at zero after each call."""
    from ft.layers import triton_gemv
    from ft.moe.kernels import triton_moe_gemv as mod
    from tests.nvfp4.test_w4a16_gpu import random_bank
    from tests.test_moe_fusions_interp import programs_shuffled

    gen = torch.Generator().manual_seed(1)
    e, h, t = 12, 320, 3  # H: two row blocks and a tail at the interpreter's down tiles
    for k, inter, fmt, shared in ((10, 48, "fp16", False), (3, 640, "fp16", True), (1, 32, "nvfp4", False),
                                  (3, 48, "nvfp4", True), (0, 48, "fp16", True)):  # fmt: skip
        if fmt == "nvfp4":
            w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
            dtype = torch.bfloat16
        else:
            w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).half()
            w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).half()
            dtype = torch.float16
        x = torch.randn(t, h, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen) / max(k, 1)
        pair = None
        if shared:
            pair = (
                (torch.randn(2 * inter, h, generator=gen) * h**-0.5).to(dtype),
                (torch.randn(h, inter, generator=gen) * inter**-0.5).to(dtype),
                torch.randn(t, 1, generator=gen).to(dtype),
            )
        outs = []
        for seed in (k + inter, k + inter + 1):  # else a row block's pairs always finish in order
            with programs_shuffled(seed):
                outs.append(mod.launch_moe_gemv(x, w13, w2, weights, ids, pair))
            require(not triton_gemv.tickets(x.device).any(), f"k={k} {fmt}: a ticket counter left non-zero")
        require(torch.equal(outs[0], outs[1]), f"k={k} I={inter} {fmt} shared={shared}: results differ")


VARIANTS = ((), ("FP4_PLANES",), ("FP4_PLANES", "FP4_DOWN_PLANES"))


def check_moe_gemv_fp4_planes() -> None:
    """``triton_moe_gemv.FP4_PLANES`` (the gate/up kernel's NVFP4 codes decoded from 32-bit words, a
    block's scale once), with ``FP4_DOWN_PLANES`` (the down kernel too), against the byte-wise decode
    and the torch reference: the same weights, so the results agree to the fp32 order of the
    partial sums (an output within one bf16 step); k = 1, 3 and 10, H over one K step, one with a
    tail, several, and several then a tail, with and without a shared expert."""
    from ft.moe.kernels import triton_moe_gemv as mod
    from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref
    from tests.nvfp4.test_w4a16_gpu import random_bank

    mod.FP4_INT_DOT = False  # the words' own products (the integer ones: check_moe_gemv_int_dot)
    gen = torch.Generator().manual_seed(2)
    e, t = 12, 3
    for k, h, inter, shared in ((10, 64, 32, False), (3, 48, 48, True), (1, 1024, 320, False),
                                (3, 528, 32, False), (3, 64, 48, True)):  # fmt: skip
        w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen) / k
        pair = None
        if shared:
            pair = (
                (torch.randn(2 * inter, h, generator=gen) * h**-0.5).to(torch.bfloat16),
                (torch.randn(h, inter, generator=gen) * inter**-0.5).to(torch.bfloat16),
                torch.randn(t, 1, generator=gen).to(torch.bfloat16),
            )
        outs = {}
        # bytes first, then words as they are switched on (the largest case without words in gate/up
        # alone, which the others cover: the interpreter's time)
        for on in VARIANTS if h < 1024 else (VARIANTS[0], VARIANTS[2]):
            mod.FP4_PLANES, mod.FP4_DOWN_PLANES = "FP4_PLANES" in on, "FP4_DOWN_PLANES" in on
            outs[on] = mod.launch_moe_gemv(x, w13, w2, weights, ids, pair).float()
        bytes_out = outs[()]
        step = bytes_out.abs().clamp(min=1e-3) * 2**-7  # one bf16 step (8 significant bits)
        want = None if shared else fused_moe_nvfp4_ref(x.float(), w13, w2, weights, ids).float()
        for on, got in outs.items():
            what = f"k={k} H={h} I={inter} shared={shared} words {on}"
            require(bool(((got - bytes_out).abs() <= step).all()), f"{what}: disagrees with bytes")
            if want is not None:
                err = ((got - want).norm() / want.norm()).item()
                require(err < 1e-2, f"{what}: relative error {err:.3g} against the torch reference")


CHECKS = [
    "check_conv_decode_one_launch",
    "check_moe_gemv_down_order",
    "check_moe_gemv_fp4_planes",
]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    run_check("tests.test_decode_switches_interp", check, optimize=True)


def test_codes_read_as_words_only_when_4_byte_aligned():
    """``moe_gemv_operands.word_aligned``: the words' paths take a code tensor whose start and row
    strides are multiples of 4 bytes; a view off by a byte, or rows of an odd width, read bytes."""
    pytest.importorskip("triton")
    from ft.moe.kernels.moe_gemv_operands import word_aligned

    flat = torch.zeros(4 * 8 * 1024 + 4, dtype=torch.uint8)
    whole = flat[: 4 * 8 * 1024].view(4, 8, 1024)
    assert word_aligned(whole)
    assert not word_aligned(whole, flat[1 : 1 + 4 * 8 * 1024].view(4, 8, 1024))  # a byte in
    assert not word_aligned(torch.zeros(4, 8, 1026, dtype=torch.uint8)[:, :, :1024])  # rows 1026 apart
