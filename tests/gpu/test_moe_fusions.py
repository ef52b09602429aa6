"""The MoE block's fused Triton kernels against their torch references, on fresh random inputs.

Router (softmax + top-k + renormalise), the fused MoE's sum over top-k with and without the
gated shared expert, the gated add alone, the SwiGLU activation, and a whole ``SparseMoeBlock``
on CUDA against the torch path. Marked ``gpu``; triton is imported inside the tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gpu = pytest.mark.gpu
TOKENS = [1, 7, 64, 4096]
ROUTERS = [(512, 10), (128, 8)]  # (E, k): Qwen3-Next, Qwen3-30B-A3B


def tie_free_logits(t: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] distinct values k/64, |k| <= 256, exact in bf16: torch.topk's tie order never matters."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ranks = torch.rand(t, 512, generator=g, device="cuda").argsort(-1)[:, :e]
    return ((ranks.float() - 256) / 64).to(dtype)


def within_rounding(got: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype) -> float:
    """max |got - exact| / (half an ulp of the result + fp32 accumulation error); <= 1 passes."""
    half_ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}[dtype]  # relative
    bound = half_ulp * exact.abs() + 32 * 2**-24 * terms + 1e-30
    return ((got.double() - exact).abs() / bound).max().item()


@gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e,k", ROUTERS)
@pytest.mark.parametrize("t", TOKENS)
def test_softmax_topk_equals_route(t, e, k, dtype, renormalize):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_router import softmax_topk
    from ft.moe.router import route

    logits = tie_free_logits(t, e, dtype, seed=t + e)
    weights, ids = softmax_topk(logits, k, renormalize)
    ref_w, ref_ids = route(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == ref_ids.dtype == torch.int64
    assert weights.shape == ids.shape == (t, k) and weights.is_contiguous() and ids.is_contiguous()
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)


@gpu
def test_softmax_topk_breaks_ties_by_lowest_expert_and_reads_strided_rows():
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_router import softmax_topk
    from ft.moe.router import route

    logits = torch.zeros(2, 16, device="cuda")
    logits[:, [3, 9]] = 1.0
    weights, ids = softmax_topk(logits, 4, renormalize=False)
    assert ids.tolist() == [[3, 9, 0, 1]] * 2
    wide = torch.randn(5, 600, device="cuda")[:, 7:519]  # rows 600 apart
    weights, ids = softmax_topk(wide, 10, renormalize=True)
    ref_w, ref_ids = route(wide, 10, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [10, 8, 1])
@pytest.mark.parametrize("t", TOKENS)
def test_sum_topk_rounds_the_fp32_sum_once(t, k, dtype):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_combine import sum_topk

    y = torch.randn(t, k, 2048, device="cuda").to(dtype)
    got = sum_topk(y)
    assert got.shape == (t, 2048) and got.dtype == dtype
    exact = y.double().sum(1)
    assert within_rounding(got, exact, y.double().abs().sum(1), dtype) <= 1.0
    torch.testing.assert_close(got, y.sum(dim=1), atol=1e-5, rtol=2**-7)  # torch's: an ulp apart at most


@gpu
@pytest.mark.parametrize("h", [2048, 1000])
@pytest.mark.parametrize("t", TOKENS)
def test_sum_topk_with_the_gated_shared_expert(t, h):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_combine import sum_topk

    y = torch.randn(t, 10, h, device="cuda").to(torch.bfloat16)
    gate = torch.randn(t, 1, device="cuda").to(torch.bfloat16)
    shared = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    got = sum_topk(y, gate, shared)
    term = torch.sigmoid(gate.double()) * shared.double()
    exact = y.double().sum(1) + term
    assert within_rounding(got, exact, y.double().abs().sum(1) + term.abs(), torch.bfloat16) <= 1.0


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", TOKENS)
def test_gated_add(t, dtype):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_combine import gated_add

    y, shared = (torch.randn(t, 2048, device="cuda").to(dtype) for _ in range(2))
    gate = torch.randn(t, 1, device="cuda").to(dtype)
    got = gated_add(y, gate, shared)
    term = torch.sigmoid(gate.double()) * shared.double()
    exact = y.double() + term
    assert got.dtype == dtype and within_rounding(got, exact, y.double().abs() + term.abs(), dtype) <= 1.0


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [512, 768, 64, 1000])
@pytest.mark.parametrize("t", TOKENS)
def test_silu_and_mul(t, inter, dtype):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_combine import silu_and_mul

    h = (torch.randn(t, 2 * inter, device="cuda") * 3).to(dtype)
    got = silu_and_mul(h)
    gate, up = h.float().chunk(2, dim=-1)
    ref = (F.silu(gate) * up).to(dtype)  # fp32, rounded once
    assert got.shape == (t, inter) and got.dtype == dtype
    tol = {torch.bfloat16: 2**-7, torch.float32: 1e-6}[dtype]  # an ulp: the fp32 sigmoids differ
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=tol)
    torch.testing.assert_close(got, F.silu(h[:, :inter]) * h[:, inter:])  # the unfused torch form


def build_block(device: str, dtype: torch.dtype, seed: int = 0, e: int = 64, k: int = 8, shared: int = 256):
    """A Qwen3-Next-shaped SparseMoeBlock (H=256, I=128, shared I=256) with random weights."""
    from ft.distributed import TPInfo, tp_context
    from ft.moe.block import SparseMoeBlock

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the bank picks its kernel for the default dtype
    try:
        with tp_context(TPInfo(0, 1)), torch.device(device):
            block = SparseMoeBlock(256, e, k, 128, True, shared_intermediate_size=shared)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5).to(p.device, p.dtype))
    return block


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 7, 64])
def test_block_on_cuda_equals_the_cpu_torch_path_in_fp32(t):
    pytest.importorskip("triton")
    cpu, cuda = build_block("cpu", torch.float32), build_block("cuda", torch.float32)
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t))
    got, ref = cuda(x.cuda()), cpu(x)
    ids_gpu, ids_cpu = cuda.gate(x.cuda())[1], cpu.gate(x)[1]
    same = (ids_gpu.cpu() == ids_cpu).all(-1)  # a near tie may route a row differently
    assert same.float().mean() > 0.9
    torch.testing.assert_close(got.cpu()[same], ref[same], atol=1e-4, rtol=1e-4)


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 7, 64, 4096])
def test_block_fused_kernels_match_the_unfused_torch_path_in_bf16(t, monkeypatch):
    pytest.importorskip("triton")
    import ft.moe.block
    import ft.moe.router

    block = build_block("cuda", torch.bfloat16)
    assert block.experts.kernel_name == "triton-bf16"
    x = torch.randn(t, 256, device="cuda").to(torch.bfloat16)
    fused = block(x)
    fused_ids = block.gate(x)[1]
    monkeypatch.setattr(ft.moe.router, "softmax_topk", None)
    monkeypatch.setattr(ft.moe.block, "fused_silu_and_mul", None)
    monkeypatch.setattr(ft.moe.block, "fused_gated_add", None)
    unfused = block(x)
    # bf16 logits do tie, and torch.topk orders tied experts freely: compare the chosen sets
    same = (fused_ids.sort(-1).values == block.gate(x)[1].sort(-1).values).all(-1)
    assert same.float().mean() > 0.9
    err = ((fused - unfused).float()[same].norm() / unfused.float()[same].norm()).item()
    assert err < 1e-2, f"T={t}: relative error {err:.3g}"


@gpu
@torch.no_grad()
@pytest.mark.parametrize("t", [1, 4])
def test_block_runs_a_shared_expert_as_wide_as_a_routed_one_inside_the_gemv(t, monkeypatch):
    """With ``triton_moe_gemv.SHARED_AS_PAIR`` on, a decode-sized batch runs the shared expert as
    one more pair of the routed GEMV (one call, given the shared expert), within bf16 error of
    its own four launches."""
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_moe_gemv

    block = build_block("cuda", torch.bfloat16, shared=128)
    x = torch.randn(t, 256, device="cuda").to(torch.bfloat16)
    separate = block(x)
    calls, real = [], triton_moe_gemv.fused_moe_gemv

    def spy(*args):
        calls.append(len(args) > 5 and args[5] is not None)
        return real(*args)

    monkeypatch.setattr(triton_moe_gemv, "fused_moe_gemv", spy)
    monkeypatch.setattr(triton_moe_gemv, "SHARED_AS_PAIR", True)
    paired = block(x)
    assert calls == [True]
    err = ((paired - separate).float().norm() / separate.float().norm()).item()
    assert err < 1e-2, f"T={t}: relative error {err:.3g}"
