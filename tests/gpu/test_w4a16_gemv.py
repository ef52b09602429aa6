"""The W4A16 GEMV path for decode sizes equals the NVFP4 torch reference and the MMA W4A16 kernel
on the GPU (marker ``gpu``): Qwen3-Next's shape (512 experts, H=2048, I=512, top-10) at T = 1..16,
a tensor-parallel I=256 shard and an I whose K tail is not a whole step, the dispatch from
``fused_moe_w4a16``, and CUDA-graph capture with the experts read on the device."""

from __future__ import annotations

import pytest
import torch

from tests.nvfp4.test_w4a16_gpu import random_bank, rel_err, routing

pytestmark = pytest.mark.gpu


def problem(t: int, e: int, inter: int, h: int, topk: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
    x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, e, topk, gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("inter", [512, 256, 48])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16])
def test_gemv_equals_reference_and_mma_kernel(t, inter, monkeypatch):
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_w4a16
    from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref
    from ft.moe.kernels.triton_w4a16_gemv import fused_moe_w4a16_gemv

    x, w13, w2, weights, ids = problem(t, 512, inter, 2048, 10, seed=t + inter)
    got = fused_moe_w4a16_gemv(x, w13, w2, weights, ids)
    assert got.shape == (t, 2048) and got.dtype == torch.bfloat16
    ref = fused_moe_nvfp4_ref(x.float(), w13, w2, weights, ids)
    err = rel_err(got, ref)
    assert err < 2e-2, f"T={t} I={inter}: relative error {err:.3g} against the torch reference"
    monkeypatch.setattr(triton_w4a16, "GEMV_MAX_TOKENS", 0)  # the MMA path, whatever the default
    mma = triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids)
    # same bf16 rounding points (act, y, out); only the fp32 summation order differs
    err = rel_err(got, mma)
    assert err < 2e-3, f"T={t} I={inter}: relative error {err:.3g} against the MMA W4A16 kernel"


def test_dispatch_by_token_count(monkeypatch):
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_w4a16, triton_w4a16_gemv

    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return gemv(*args)

    gemv = triton_w4a16_gemv.fused_moe_w4a16_gemv
    monkeypatch.setattr(triton_w4a16_gemv, "fused_moe_w4a16_gemv", spy)
    monkeypatch.setattr(triton_w4a16, "GEMV_MAX_TOKENS", 4)
    for t in (4, 5):
        x, w13, w2, weights, ids = problem(t, 64, 128, 256, 4, seed=t)
        out = triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids)
        assert out.shape == (t, 256)
    assert calls == [4], f"only T <= GEMV_MAX_TOKENS should take the GEMV path, got calls for T in {calls}"


def test_cuda_graph_replays_new_tokens_and_experts():
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_w4a16_gemv import fused_moe_w4a16_gemv

    x, w13, w2, weights, ids = problem(2, 512, 512, 2048, 10, seed=11)
    fused_moe_w4a16_gemv(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_w4a16_gemv(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = problem(2, 512, 512, 2048, 10, seed=12)
    for a, b in ((x, x2), (weights, weights2), (ids, ids2)):
        a.copy_(b)
    graph.replay()
    assert torch.equal(out, fused_moe_w4a16_gemv(x2, w13, w2, weights2, ids2))
