"""The router with the shared expert's gate folded in, on CUDA: the Triton kernels read the [T, E]
and [T, 1] strided views of the [T, E + 1] logits as they read contiguous tensors, and the fused
router equals the two separate products. The router GEMV with its top-k softmax epilogue
(``triton_router_gemv``, one launch) against the GEMV then ``softmax_topk``, behind
``TopKRouter`` with its switch on, and inside a CUDA graph. Marked ``gpu``; triton is imported
inside the tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e,k", [(512, 10), (128, 8), (60, 4)])
@pytest.mark.parametrize("t", [1, 7, 4096])
def test_softmax_topk_and_gated_add_read_strided_views(t, e, k, dtype):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_combine import gated_add
    from ft.moe.kernels.triton_router import softmax_topk
    from ft.moe.router import route

    g = torch.Generator(device="cuda").manual_seed(t + e)
    pool = torch.arange(-2048, 2048, device="cuda").to(torch.bfloat16).unique().float() / 256  # ~1,280 values
    pick = torch.rand(t, pool.numel(), generator=g, device="cuda").argsort(-1)[:, : e + 1]
    logits = pool[pick].to(dtype)  # distinct per row and exact in bf16: no top-k ties
    experts, shared_logit = logits[:, :-1], logits[:, -1:]
    assert experts.stride(0) == shared_logit.stride(0) == e + 1
    weights, ids = softmax_topk(experts, k, renormalize=True)
    ref_w, ref_ids = route(experts.contiguous(), k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
    y, shared = torch.randn(t, 256, device="cuda").to(dtype), torch.randn(t, 256, device="cuda").to(dtype)
    assert torch.equal(gated_add(y, shared_logit, shared), gated_add(y, shared_logit.contiguous(), shared))


@gpu
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_fused_router_equals_the_separate_products_on_cuda(t, dtype):
    pytest.importorskip("triton")
    from ft.moe.router import TopKRouter, route

    h, e, k = 2048, 512, 10
    with torch.device("cuda"):
        router = TopKRouter(h, e, k, True, shared_gate=True).to(dtype)
    g = torch.Generator(device="cuda").manual_seed(t)
    router.weight.copy_(torch.randn(e + 1, h, generator=g, device="cuda") * h**-0.5)
    x = torch.randn(t, h, generator=g, device="cuda").to(dtype)
    weights, ids, shared_logit = router(x)
    logits = F.linear(x, router.weight[:e])
    ref_w, ref_ids = route(logits, k, True)
    # cuBLAS may pick another kernel for E + 1 columns: near-tied experts may swap, sets mostly agree
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert same.float().mean() > 0.9
    torch.testing.assert_close(weights[same], ref_w[same], atol=1e-2, rtol=1e-2)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(shared_logit, F.linear(x, router.weight[e:]), atol=tol, rtol=tol)


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 64, 65, 3000])
def test_router_over_padded_rows_equals_the_parameter(t):
    """Above ``PAD_MIN_TOKENS`` tokens the GEMM runs over the 520-row storage; its logits, read
    as [T, 512] and [T, 1] views 520 apart, route as the 513-row parameter's do."""
    pytest.importorskip("triton")
    from ft.moe.router import PAD_MIN_TOKENS, TopKRouter, route

    torch.manual_seed(t)
    with torch.device("cuda"):
        router = TopKRouter(2048, 512, 10, True, shared_gate=True)
    assert router._padded.is_cuda and router._padded.data_ptr() == router.weight.data_ptr()
    router.weight.normal_(0.0, 2048**-0.5)
    x = torch.randn(t, 2048, device="cuda", dtype=torch.float32)
    weights, ids, shared_logit = router(x)
    logits = F.linear(x, router.weight)
    assert shared_logit.stride(0) == (520 if t > PAD_MIN_TOKENS else 513)
    ref_w, ref_ids = route(logits[:, :512], 10, True)
    assert (ids == ref_ids).float().mean() > 0.999  # fp32 GEMMs of another shape: rare near-ties
    torch.testing.assert_close(shared_logit, logits[:, 512:], atol=1e-4, rtol=1e-4)


FUSED_CASES = [((512, 10, True), 2048), ((128, 8, False), 2048)]  # (E, k, shared gate), H


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("h", [2048, 2880])
def test_fused_router_leaves_the_int16_blocks_on_x(t, h):
    """``router_topk(..., blocks=True)``: the same routing, and x's int16 blocks for the MoE GEMV
    (``triton_moe_gemv.FP4_INT_DOT``) as ``quantize_blocks`` makes them and the torch rule, bit
    for bit, over every split; left on x once (``take_blocks``)."""
    pytest.importorskip("triton")
    from ft.moe.kernels import int_dot
    from ft.moe.kernels.triton_router_gemv import router_topk
    from tests.gpu.test_moe_gemv import quantize_blocks_ref

    g = torch.Generator(device="cuda").manual_seed(t + h)
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    x[0, 16:32] = 0.0
    w = (torch.randn(513, h, generator=g, device="cuda") * h**-0.5).to(torch.bfloat16)
    plain = router_topk(x, w, 10, True, True)
    assert getattr(x, int_dot.BLOCKS_ATTR, None) is None
    routed = router_topk(x, w, 10, True, True, blocks=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, routed))
    blocks = int_dot.take_blocks(x)
    assert blocks is not None and int_dot.take_blocks(x) is None
    for got, launch, ref in zip(blocks, int_dot.quantize_blocks(x), quantize_blocks_ref(x)):
        assert torch.equal(got, launch) and torch.equal(got, ref)


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 2])
def test_moe_block_takes_the_routers_int16_blocks(t, monkeypatch):
    """An NVFP4 ``SparseMoeBlock`` with ``FP4_INT_DOT``: the router makes x's int16 blocks, the MoE
    GEMV takes them instead of its own quantising launch (never called), and the output is the
    bits of the block whose GEMV quantises x itself."""
    pytest.importorskip("triton")
    from ft.distributed import TPInfo, tp_context
    from ft.moe.block import SparseMoeBlock
    from ft.moe.kernels import int_dot, triton_moe_gemv

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the bank picks its kernel for the default dtype
    try:
        with tp_context(TPInfo(0, 1)), torch.device("cuda"):
            block = SparseMoeBlock(2048, 64, 8, 256, True, 256, expert_format="nvfp4")
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device="cuda").manual_seed(t)
    for name, p in block.named_parameters():  # codes any bytes, scales and globals positive
        if p.dtype == torch.uint8:
            p.copy_(torch.randint(0, 256, p.shape, generator=gen, device="cuda", dtype=torch.uint8))
        elif p.dtype == torch.float8_e4m3fn or name.endswith("global"):
            p.copy_((torch.rand(p.shape, generator=gen, device="cuda") * 0.5 + 0.25).to(p.dtype))
        else:
            p.copy_((torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5).to(p.dtype))
    x = torch.randn(t, 2048, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(triton_moe_gemv, "FP4_INT_DOT", True)
    assert block._int_blocks(x)
    own = block(x.clone())  # a fresh x each call: nothing left on it
    launches = []
    quantize = int_dot.quantize_blocks
    monkeypatch.setattr(int_dot, "quantize_blocks", lambda v: launches.append(v) or quantize(v))
    routed = block(x.clone())
    assert not launches, "the MoE GEMV quantised x although the router had"
    monkeypatch.setattr(int_dot, "take_blocks", lambda v: None)
    apart = block(x.clone())
    assert len(launches) == 1 and torch.equal(routed, apart) and torch.equal(routed, own)


@gpu
@torch.no_grad()
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_router_equals_the_gemv_then_softmax_topk(case, t, renormalize):
    """``router_topk`` (the router GEMV split over K, the top-k softmax as its epilogue) against
    ``launch_gemv`` with the same splits, then ``softmax_topk``: the same logits bits (the gate
    column), the same ids, weights to 1e-5; the ticket counters zero after."""
    pytest.importorskip("triton")
    from ft.layers import triton_gemv
    from ft.moe.kernels.triton_router import softmax_topk
    from ft.moe.kernels.triton_router_gemv import router_topk

    (e, k, gate), h = case
    g = torch.Generator(device="cuda").manual_seed(t + e)
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(e + gate, h, generator=g, device="cuda") * h**-0.5).to(torch.bfloat16)
    weights, ids, shared = router_topk(x, w, k, renormalize, gate)
    logits = triton_gemv.launch_gemv(x, w, triton_gemv.balanced_splits(e + gate, h, x.device))
    ref_w, ref_ids = softmax_topk(logits[:, :e], k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)
    assert torch.equal(shared, logits[:, e:]) if gate else shared is None
    assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 4, 5])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_router_with_the_fused_switch_on_routes_as_the_unfused_path(case, t, monkeypatch):
    """``TopKRouter`` with ``FUSED_ROUTER`` on takes one launch for up to ``MAX_TOKENS`` bf16
    tokens (and the unfused path above), giving, on tie-free logits exact in any summation order,
    the unfused path's ids and weights to 1e-5 and its gate logit to a bf16 rounding."""
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_router_gemv
    from ft.moe.router import TopKRouter, route
    from tests.test_moe_fusions_interp import exact_router_operands

    (e, k, gate), h = case
    x, w, exact = (a.cuda() for a in exact_router_operands(t, e, h, gate, seed=t, dtype=torch.bfloat16))
    with torch.device("cuda"):
        router = TopKRouter(h, e, k, True, shared_gate=gate).to(torch.bfloat16)
    router.weight.copy_(w)
    monkeypatch.setattr(triton_router_gemv, "FUSED_ROUTER", False)
    unfused = router(x)
    calls, real = [], triton_router_gemv.router_topk
    monkeypatch.setattr(triton_router_gemv, "router_topk", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_router_gemv, "FUSED_ROUTER", True)
    weights, ids, shared = router(x)
    assert len(calls) == (t <= triton_router_gemv.MAX_TOKENS)
    ref_w, ref_ids = route(exact, k, True)
    assert torch.equal(ids, unfused[1]) and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, unfused[0], atol=1e-5, rtol=1e-5)
    if gate:
        torch.testing.assert_close(shared, unfused[2], atol=2e-2, rtol=2e-2)


@gpu
@torch.no_grad()
def test_fused_router_replays_in_a_cuda_graph():
    """Captured once, replayed twice and on new inputs: the eager call's bits each time, the ticket
    counters zero after each replay."""
    pytest.importorskip("triton")
    from ft.layers import triton_gemv
    from ft.moe.kernels.triton_router_gemv import router_topk

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 2048, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(513, 2048, generator=g, device="cuda") * 2048**-0.5).to(torch.bfloat16)
    eager = router_topk(x, w, 10, True, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_topk(x, w, 10, True, True)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, eager))
        assert not triton_gemv.tickets(x.device).any()
    x.copy_(torch.randn(4, 2048, generator=g, device="cuda").to(torch.bfloat16))
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, router_topk(x, w, 10, True, True)))


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 3, 4, 7])
def test_int32_keys_pick_as_the_int64_keys(t, monkeypatch):
    """``triton_router.KEYS32`` on CUDA: bf16 logits with ties and negative rows give the same ids
    and weights, bit for bit, through ``softmax_topk`` and the fused router (up to its 4 tokens)."""
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_router, triton_router_gemv

    g = torch.Generator(device="cuda").manual_seed(t)
    tied = torch.randint(-12, 12, (t, 512), generator=g, device="cuda").float() / 4
    tied[1::2] -= 8
    tied = tied.to(torch.bfloat16)
    x = torch.randn(t, 2048, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(513, 2048, generator=g, device="cuda") * 2048**-0.5).to(torch.bfloat16)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(triton_router, "KEYS32", on)
        got = [*triton_router.softmax_topk(tied, 10, True)]
        if t <= triton_router_gemv.MAX_TOKENS:
            got += [*triton_router_gemv.router_topk(x, w, 10, True, True)]
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
