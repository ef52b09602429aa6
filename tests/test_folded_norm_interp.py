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
    from ft.moe.kernels import int_dot
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
        blocks = int_dot.empty_blocks(x)
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


def check_proj_conv() -> None:
    """``triton_conv_proj.launch_proj_conv`` (the input projection with the decode conv as its
    epilogue) equals ``launch_gemv`` (or ``launch_normed_gemv`` for a folded norm) then the decode
    conv kernel, bit for bit: the conv channels, the others, every sequence's history after (some
    sequences without context), in any program order. Conv channels ending inside a program's
    columns and at a boundary; 1..4 sequences."""
    import triton

    from ft.gdn import triton_conv, triton_conv_proj
    from ft.layers import triton_gemv
    from ft.layers.norm import FoldedNorm, RMSNorm
    from tests.test_moe_fusions_interp import programs_shuffled

    gen = torch.Generator().manual_seed(7)
    for b, n, k, c, kc, folded in ((1, 100, 64, 40, 4, False), (3, 130, 300, 64, 4, True),
                                   (4, 96, 128, 80, 3, False), (2, 72, 256, 72, 4, True)):  # fmt: skip
        x = torch.randn(b, k, generator=gen).half()
        w = (torch.randn(n, k, generator=gen) * k**-0.5).half()
        conv_w = torch.randn(c, kc, generator=gen).half()
        state = torch.randn(b + 3, c, kc - 1, generator=gen).half()
        slots = torch.randperm(b + 3, generator=gen)[:b]
        context = torch.randint(0, 3, (b,), generator=gen).int()
        context[0] = 0  # a sequence's first token: no history
        if folded:
            norm = RMSNorm(k, 1e-6, zero_centered=True)
            norm.weight.data = (torch.rand(k, generator=gen) * 0.2).half()
            r = torch.randn(b, k, generator=gen).half()
            pre = FoldedNorm(norm, x, r)
            h = torch.empty_like(x)
            y = triton_gemv.launch_normed_gemv(x, r, norm.weight.data, 1e-6, True, w, h)
        else:
            pre, y = x, triton_gemv.launch_gemv(x, w)
        want_state = state.clone()
        want = torch.empty(b, c, dtype=x.dtype)
        triton_conv._conv_decode_kernel[(b, triton.cdiv(c, 256))](
            y, conv_w, want_state, context, slots, want, c, y.stride(0), want.stride(0), conv_w.stride(0),
            want_state.stride(0), want_state.stride(1), KC=kc, KP=triton.next_power_of_2(kc), BLOCK_C=256,
        )  # fmt: skip
        got_state = state.clone()
        with programs_shuffled(b + n):
            got = triton_conv_proj.launch_proj_conv(pre, w, conv_w, got_state, context, slots)
        assert torch.equal(got[:, :c], want), (b, n, c)
        assert torch.equal(got[:, c:], y[:, c:]), (b, n, c)
        assert torch.equal(got_state, want_state), (b, n, c)
        if folded:
            assert torch.equal(pre.h, h), (b, n, c)


def check_model_with_conv_in_projection() -> None:
    """A Qwen3-Next model decoding on the CPU (fp16) with ``CONV_IN_PROJ`` on, the interpreter
    running the projection's kernel in place of the GEMV and the torch backend's conv: the same
    greedy tokens as with it off and log-probs within fp16 rounding, over steps whose histories
    the kernel shifted (a wrong shift or a skipped conv changes the tokens of this random model)."""
    import tempfile

    from ft import LLM, SamplingParams
    from ft.gdn import triton_conv_proj
    from ft.gdn.torch_ref import TorchGDN
    from tests.checkpoints import write_checkpoint

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = [[5, 17, 3, 88, 41, 9], [30, 1, 64]]
    calls = []
    launch = triton_conv_proj.launch_proj_conv
    triton_conv_proj.launch_proj_conv = lambda *args: calls.append(1) or launch(*args)
    triton_conv_proj.takes = lambda x, w: len(x) <= 4  # the CPU's fp16 tensors too
    TorchGDN.folds_decode_conv = True  # its decode conv stands in for triton_conv's
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path, "qwen3_next", seed=3)
        outs = []
        for on in (False, True):
            triton_conv_proj.CONV_IN_PROJ = on
            with LLM(model=path, device="cpu", dtype="float16", progress=False) as llm:
                outs.append(llm.generate(prompts, params))
    assert calls, "the projection's kernel never ran"
    for off, on in zip(*outs):
        assert on.token_ids == off.token_ids
        for a, b, tok in zip(off.logprobs, on.logprobs, off.token_ids):
            assert abs(a[tok] - b[tok]) < 2e-2, (a[tok], b[tok])


CHECKS = [
    "check_normed_gemv",
    "check_folded_router",
    "check_proj_conv",
    "check_model_with_conv_in_projection",
]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    run_check("tests.test_folded_norm_interp", check)
