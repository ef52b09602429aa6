"""The router with the shared expert's gate folded in, on CUDA: the Triton kernels read the [T, E]
and [T, 1] strided views of the [T, E + 1] logits as they read contiguous tensors, and the fused
router equals the two separate products. Marked ``gpu``; triton is imported inside the tests.
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
