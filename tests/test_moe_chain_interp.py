"""The MoE GEMV as one launch (``ft.moe.kernels.moe_gemv_chain``), off until timed, against the
launches it replaces, run by Triton's interpreter on CPU tensors. The interpreter runs a launch's programs
one at a time, so a tile that waits for others finds them done: what these check is the arithmetic,
the tiles' coverage and the counters' reset; ``tests/gpu/test_moe_gemv.py`` runs the waits.
Skipped without triton (CI has it)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def problem(
    k: int, inter: int, fmt: str, shared: bool, t: int, gen: torch.Generator, e: int = 12, h: int = 320
):
    """(x, w13, w2, the shared expert's (gate_up, down) or None) of a bank in ``fmt``."""
    from tests.nvfp4.test_w4a16_gpu import random_bank

    if fmt == "fp16":
        w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).half()
        w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).half()
        dtype = torch.float16
    else:
        w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
        dtype = torch.bfloat16
    x = torch.randn(t, h, generator=gen).to(dtype)
    pair = None
    if shared:
        pair = (
            (torch.randn(2 * inter, h, generator=gen) * h**-0.5).to(dtype),
            (torch.randn(h, inter, generator=gen) * inter**-0.5).to(dtype),
        )
    return x, w13, w2, pair


def words(fmt: str) -> None:
    """The NVFP4 GEMV's code paths by ``fmt``: bytes ("nvfp4"), words, integer products."""
    from ft.moe.kernels import triton_moe_gemv as mod

    mod.FP4_PLANES = mod.FP4_DOWN_PLANES = fmt in ("words", "int")
    mod.FP4_INT_DOT = fmt == "int"


def within_a_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    step = want.float().abs().clamp(min=1e-3) * 2**-7  # one bf16 step (8 significant bits)
    return bool(((got.float() - want.float()).abs() <= step).all())


def check_moe_gemv_chain() -> None:
    """``moe_gemv_chain.CHAIN`` (gate/up and down tiles in one launch, each down tile waiting for its
    pair's gate/up tiles): the two launches' results to one bf16 step of each output (the down sums'
    lane order follows the warps), the same bits for any order the programs start in, every counter
    back at zero after each call. fp16 and NVFP4 banks (bytes, words, integer products), k = 0, 1, 3
    and 10, with and without a shared expert, I over one step and several, H over several row
    blocks with a tail."""
    from ft.layers import triton_gemv
    from ft.moe.kernels import moe_gemv_chain
    from ft.moe.kernels import triton_moe_gemv as mod
    from tests.test_moe_fusions_interp import programs_shuffled

    gen = torch.Generator().manual_seed(3)
    cases = ((10, 48, "fp16", False, 2), (3, 640, "fp16", True, 1), (1, 32, "nvfp4", False, 3),
             (3, 48, "nvfp4", True, 2), (0, 48, "fp16", True, 2), (3, 64, "words", True, 2),
             (10, 32, "int", False, 1))  # fmt: skip
    for k, inter, fmt, shared, t in cases:
        words(fmt)
        x, w13, w2, pair = problem(k, inter, fmt, shared, t, gen)
        ids = torch.stack([torch.randperm(12, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen) / max(k, 1)
        pair = None if pair is None else (*pair, torch.randn(t, 1, generator=gen).to(x.dtype))
        what = f"k={k} I={inter} {fmt} shared={shared} T={t}"
        moe_gemv_chain.CHAIN = False
        two = mod.launch_moe_gemv(x, w13, w2, weights, ids, pair)
        moe_gemv_chain.CHAIN = True
        outs = []
        for seed in (k + inter, k + inter + 1):
            with programs_shuffled(seed):
                outs.append(mod.launch_moe_gemv(x, w13, w2, weights, ids, pair))
            require(not triton_gemv.tickets(x.device).any(), f"{what}: a counter left non-zero")
        require(torch.equal(outs[0], outs[1]), f"{what}: results differ between program orders")
        require(within_a_step(outs[0], two), f"{what}: off the two launches")


def check_chain_with_host_rows() -> None:
    """The chain with host reads (ids e < 0: host row -e - 1): the two launches' result to a bf16
    step, fp16 and NVFP4 (words) banks, a shared pair; the slots no expert holds and the host rows
    of the experts in slots are NaN, so a tile reading the wrong side fails."""
    from ft.moe.kernels import moe_gemv_chain
    from ft.moe.kernels import triton_moe_gemv as mod
    from ft.quant.nvfp4 import NVFP4Tensor

    gen = torch.Generator().manual_seed(6)
    e, inter, t, k, s = 8, 48, 2, 3, 4
    for fmt in ("fp16", "words"):
        words(fmt)
        x, w13, w2, pair = problem(k, inter, fmt, True, t, gen, e, 64)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen) / k
        pair = (*pair, torch.randn(t, 1, generator=gen).to(x.dtype))
        in_slot = torch.randperm(e, generator=gen)[:s]
        route = -(torch.arange(e) + 1)  # every expert on the host but these, in slots 0 .. s-1
        route[in_slot] = torch.arange(s)
        holder = torch.zeros(s + 1, dtype=torch.long)
        holder[:s] = in_slot

        def split(w, holder=holder, in_slot=in_slot):  # (slot rows, host rows), NaN where unread
            if isinstance(w, NVFP4Tensor):
                slot_g, host_g = w.weight_scale_2[holder].clone(), w.weight_scale_2.clone()
                slot_g[s], host_g[in_slot] = float("nan"), float("nan")
                return NVFP4Tensor(w.weight[holder], w.weight_scale[holder], slot_g), NVFP4Tensor(
                    w.weight, w.weight_scale, host_g
                )
            slot, host = w[holder].clone(), w.clone()
            slot[s], host[in_slot] = float("nan"), float("nan")
            return slot, host

        (s13, h13), (s2, h2) = split(w13), split(w2)
        moe_gemv_chain.CHAIN = False
        two = mod.launch_moe_gemv(x, s13, s2, weights, route[ids], pair, host=(h13, h2))
        moe_gemv_chain.CHAIN = True
        one = mod.launch_moe_gemv(x, s13, s2, weights, route[ids], pair, host=(h13, h2))
        require(bool(two.isfinite().all()) and within_a_step(one, two), f"{fmt}: off the two launches")


def check_chain_with_staging() -> None:
    """Host staging inside the chain's launch (``stage=``: staging tiles first, a host pair's
    gate/up tiles waiting for its first reader's copy): the result of ``host_stage.stage`` then the
    two launches on the staging rows, to a bf16 step, the staging block holding the same rows
    after; fp16 and NVFP4 (integer products) banks laid out in blocks as the offload backend's, two
    pairs sharing a host row (copied once), slots and host rows mixed, a shared pair."""
    from ft.layers import triton_gemv
    from ft.moe.backends import host_stage
    from ft.moe.backends.layout import ExpertLayout, Part
    from ft.moe.kernels import moe_gemv_chain
    from ft.moe.kernels import triton_moe_gemv as mod
    from ft.quant.nvfp4 import NVFP4Tensor
    from tests.test_moe_fusions_interp import programs_shuffled

    gen = torch.Generator().manual_seed(7)
    e, inter, h, t, k, s = 6, 32, 64, 2, 3, 3
    for fmt in ("fp16", "int"):
        words(fmt)
        x, w13, w2, pair = problem(k, inter, fmt, True, t, gen, e, h)
        weights = torch.rand(t, k, generator=gen) / k
        pair = (*pair, torch.randn(t, 1, generator=gen).to(x.dtype))
        bank = {"w13": w13, "w2": w2} if fmt == "fp16" else {
            f"{n}{suffix}": part for n, w in (("w13", w13), ("w2", w2))
            for suffix, part in zip(("", "_scale", "_global"), w.parts)}  # fmt: skip
        parts, offset = [], 0
        for name, tensor in bank.items():
            parts.append(Part(name, tuple(tensor.shape[1:]), tensor.dtype, offset))
            offset += -(-parts[-1].nbytes // 16) * 16
        layout = ExpertLayout(tuple(parts), -(-offset // 256) * 256)
        store, cache = layout.allocate(e, "cpu"), layout.allocate(s + 1, "cpu")
        in_slot = torch.tensor([4, 1, 5])  # experts 4, 1, 5 in slots 0 .. 2 (slot 3: the null row)
        for name, view in layout.views(store).items():
            view.copy_(bank[name])
        for name, view in layout.views(cache).items():
            view[:s].copy_(bank[name][in_slot])
        route = -(torch.arange(e) + 1)
        route[in_slot] = torch.arange(s)
        ids = torch.tensor([[0, 4, 2], [2, 3, 1]])  # expert 2 (a host row) read by two pairs
        rows = route[ids]

        def kernel(block, layout=layout, fmt=fmt):  # the kernel operands from a block's views
            v = layout.views(block)
            if fmt == "fp16":
                return v["w13"], v["w2"]
            return tuple(NVFP4Tensor(v[n], v[n + "_scale"], v[n + "_global"]) for n in ("w13", "w2"))

        staging = host_stage.StageBlock(layout, t * k, torch.device("cpu"))
        staged = host_stage.stage(rows, store, staging)
        moe_gemv_chain.CHAIN = False
        two = mod.launch_moe_gemv(x, *kernel(cache), weights, staged, pair, host=kernel(staging.block))
        copied = staging.block.clone()
        staging.block.zero_()
        with programs_shuffled(int(fmt == "int")):
            one = mod.launch_moe_gemv(x, *kernel(cache), weights, rows, pair, host=kernel(staging.block),
                                      stage=(store, staging.block))  # fmt: skip
        require(not triton_gemv.tickets(x.device).any(), f"{fmt}: a counter left non-zero")
        require(torch.equal(staging.block, copied), f"{fmt}: other staging rows")
        require(
            bool(two.isfinite().all()) and within_a_step(one, two), f"{fmt}: off staging then two launches"
        )


CHECKS = [
    "check_moe_gemv_chain",
    "check_chain_with_host_rows",
    "check_chain_with_staging",
]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    run_check("tests.test_moe_chain_interp", check, optimize=True)
