"""The kernels that fold a pre-norm into their products (``ft.layers.norm.FoldedNorm``) run by
Triton's interpreter on CPU tensors: the dense GEMV (``triton_gemv.launch_normed_gemv``) and the
fused router (``triton_router_gemv.launch_router_topk(..., norm=...)``). Each is checked against
the norm then the product in torch: exactly where every value is exact (inputs of magnitude one,
eps 0, so 1 / rms = 1), to an fp16 ulp on random inputs, with the residual stream h, the normed
input and its int16 blocks as the unfolded kernels write them. fp16: the interpreter truncates
fp32 -> bf16 where a GPU rounds. Skipped without triton."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER


def norm_ref(x, r, w, eps, zero_centered):
    """(rms_norm(x + r) as ``RMSNorm`` computes it, x + r) in x's dtype."""
    from ft.layers.norm import RMSNorm

    norm = RMSNorm(x.shape[-1], eps, zero_centered)
    norm.weight.data = w
    return norm(x, r)


def signs(shape, gen) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1


def check_normed_gemv() -> None:
    """``launch_normed_gemv`` against ``rms_norm`` then ``launch_gemv``: bit for bit when h = x + r is
    ±1 everywhere and eps 0 (1 / rms exactly 1, integer weights); within an fp16 ulp of the fp64
    product on random inputs; h = x + r rounded, bit for bit, in any program order. M = 1..4, both
    tile configurations (wide and narrow), K off the step, zero-centred and plain weights."""
    from ft.layers import triton_gemv
    from tests.test_moe_fusions_interp import programs_shuffled

    triton_gemv.WIDE_N = 96  # the wide tiles from 96 outputs: both configurations at small N
    gen = torch.Generator().manual_seed(5)
    for n, k, m, zc in ((40, 64, 1, True), (100, 300, 3, False), (130, 1000, 4, True), (33, 512, 2, False)):
        h = signs((m, k), gen)
        r = (torch.randint(-4, 5, (m, k), generator=gen)).float()
        x = h - r  # exact: x + r = h
        w = torch.randint(-2, 3, (k,), generator=gen).float()
        W = torch.randint(-3, 4, (n, k), generator=gen).half()
        x, r, nw = x.half(), r.half(), w.half()
        out_h = torch.empty_like(x)
        with programs_shuffled(n + k):
            got = triton_gemv.launch_normed_gemv(x, r, nw, 0.0, zc, W, out_h)
        a, hs = norm_ref(x, r, nw, 0.0, zc)
        assert torch.equal(out_h, hs), (n, k, m)
        assert torch.equal(got, triton_gemv.launch_gemv(a, W)), (n, k, m, zc)
        # random inputs: an fp16 ulp of the fp64 norm and product
        x = torch.randn(m, k, generator=gen).half()
        r = torch.randn(m, k, generator=gen).half()
        nw = (torch.rand(k, generator=gen) + 0.5).half()
        W = (torch.randn(n, k, generator=gen) * k**-0.5).half()
        got = triton_gemv.launch_normed_gemv(x, r, nw, 1e-6, zc, W, out_h)
        hd = (x.float() + r.float()).half().double()
        wd = nw.double() + 1 if zc else nw.double()
        ref = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd) @ W.double().T
        torch.testing.assert_close(got.double(), ref, atol=1e-3, rtol=2**-10)
        assert torch.equal(out_h, hd.half())


def check_folded_router() -> None:
    """The fused router with a folded norm: the residual stream h = x + r and the normed input a
    as ``RMSNorm`` writes them (bit for bit at 1 / rms = 1, to an fp16 ulp otherwise), a's int16
    blocks as ``quantize_blocks`` makes them from a, the ids of the fp64 logits' top k (the cases'
    k-th and (k+1)-th logits well apart), the weights and the gate logit to the logits' rounding;
    programs in a random order, the ticket counters zero after."""
    from ft.layers import triton_gemv
    from ft.layers.norm import FoldedNorm, RMSNorm
    from ft.moe.kernels import triton_moe_gemv
    from ft.moe.kernels.triton_router_gemv import launch_router_topk
    from ft.moe.router import route
    from tests.gpu.test_moe_gemv import quantize_blocks_ref
    from tests.test_moe_fusions_interp import programs_shuffled

    gen = torch.Generator().manual_seed(6)
    for (e, k, gate), t, h, zc, exact in (
        ((512, 10, True), 1, 2048, True, True),
        ((512, 10, True), 2, 512, True, False),
        ((128, 8, False), 3, 320, False, True),
        ((128, 8, False), 4, 1008, False, False),
    ):
        norm = RMSNorm(h, 0.0 if exact else 1e-6, zc)
        if exact:
            hs = signs((t, h), gen)
            r = torch.randint(-4, 5, (t, h), generator=gen).float()
            x, r = (hs - r).half(), r.half()
            norm.weight.data = torch.randint(-2, 3, (h,), generator=gen).half()
        else:
            x, r = torch.randn(t, h, generator=gen).half(), torch.randn(t, h, generator=gen).half()
            norm.weight.data = (torch.rand(h, generator=gen) + 0.5).half()
        w = (torch.randn(e + gate, h, generator=gen) * h**-0.5).half()
        a_ref, h_ref = norm_ref(x, r, norm.weight.data, norm.eps, zc)
        folded = FoldedNorm(norm, x, r)
        blocks = triton_moe_gemv.empty_blocks(x)
        with programs_shuffled(t * e + h):
            weights, ids, shared = launch_router_topk(x, w, k, True, gate, blocks=blocks, norm=folded)
        assert torch.equal(folded.h, h_ref), (e, t, h)
        if exact:
            assert torch.equal(folded.a, a_ref), (e, t, h)
        else:
            torch.testing.assert_close(folded.a, a_ref, atol=2e-3, rtol=2**-10)
        for got, want in zip(blocks, quantize_blocks_ref(folded.a)):
            assert torch.equal(got, want), (e, t, h)
        logits = a_ref.double() @ w.double().T  # [T, E (+ 1)]
        top = logits[:, :e].sort(-1, descending=True).values
        assert (top[:, k - 1] - top[:, k]).min() > 4e-3, "a case whose top k is too close to call"
        ref_w, ref_ids = route(logits[:, :e].float(), k, True)
        assert torch.equal(ids, ref_ids), (e, t, h)
        torch.testing.assert_close(weights, ref_w, atol=2e-3, rtol=1e-2)
        if gate:
            torch.testing.assert_close(shared.double(), logits[:, e:], atol=2e-3, rtol=2**-9)
        assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"


CHECKS = ["check_normed_gemv", "check_folded_router"]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    run_check("tests.test_folded_norm_interp", check)
