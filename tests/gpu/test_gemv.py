"""The Triton GEMV for decode-sized dense products equals the fp32 product within bf16 rounding and
agrees with cuBLAS on the GPU (marker ``gpu``): Qwen3-Next's projection shapes, K and N tails,
1..16 rows, strided rows, the dispatch in ``ft.layers.linear.dense`` and CUDA-graph capture; the
split-K kernel (``SPLIT_K``) within bf16 rounding of the unsplit one, the same bits call after call
and replay after replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def operands(m: int, n: int, k: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
@pytest.mark.parametrize(
    "n,k", [(12352, 2048), (2048, 4096), (513, 2048), (1024, 2048), (2048, 512), (70, 300), (4104, 300)]
)
def test_gemv_equals_fp32_product_and_cublas(m, n, k, dtype):
    pytest.importorskip("triton")
    from ft.layers.triton_gemv import gemv

    x, w = operands(m, n, k, seed=m + n + k, dtype=dtype)
    got = gemv(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, x.float() @ w.float().T) < 4e-3  # one rounding of the output
    assert rel_err(got, F.linear(x, w)) < 6e-3  # cuBLAS rounds once too, summing in another order


def test_strided_rows_and_the_dispatch(monkeypatch):
    pytest.importorskip("triton")
    from ft.layers import linear, triton_gemv

    x, w = operands(8, 256, 512, seed=3)
    xs = torch.cat([x, x], dim=1)[:, :512]  # rows 1024 apart
    torch.testing.assert_close(triton_gemv.gemv(xs, w), triton_gemv.gemv(x, w), atol=0, rtol=0)
    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    monkeypatch.setattr(triton_gemv, "GEMV_MAX_TOKENS", 4)
    for rows in (4, 5):
        linear.dense(x[:rows], w)
    linear.dense(x[:2], w, torch.zeros(256, device="cuda", dtype=torch.bfloat16))  # bias: cuBLAS
    assert calls == [4], f"only <= GEMV_MAX_TOKENS rows without bias take the GEMV, got {calls}"


def test_cuda_graph_replays_new_inputs():
    pytest.importorskip("triton")
    from ft.layers.triton_gemv import gemv

    x, w = operands(2, 2048, 4096, seed=5)
    gemv(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    x2, _ = operands(2, 2048, 4096, seed=6)
    x.copy_(x2)
    graph.replay()
    assert torch.equal(out, gemv(x2, w))


SPLIT_SHAPES = [(2048, 4096), (513, 2048), (12352, 2048), (9216, 2048), (1024, 2048), (70, 300)]


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", SPLIT_SHAPES)
def test_split_k_equals_the_unsplit_gemv(m, n, k, monkeypatch):
    """With ``SPLIT_K`` on, ``gemv`` splits K as ``splits_for`` says (the shapes that have enough
    programs stay whole) and ``launch_gemv`` as told: within bf16 rounding of the unsplit GEMV."""
    pytest.importorskip("triton")
    from ft.layers import triton_gemv

    x, w = operands(m, n, k, seed=m + n + k)
    whole = triton_gemv.launch_gemv(x, w, splits=1)
    monkeypatch.setattr(triton_gemv, "SPLIT_K", True)
    for got in [triton_gemv.gemv(x, w)] + [triton_gemv.launch_gemv(x, w, s) for s in (2, 3, 8)]:
        assert got.shape == (m, n) and got.dtype == x.dtype
        assert rel_err(got, x.float() @ w.float().T) < 4e-3
        assert rel_err(got, whole) < 6e-3
    assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"


@pytest.mark.parametrize("n,k", [(2048, 4096), (513, 2048)])
def test_split_k_is_deterministic_and_replays_in_a_cuda_graph(n, k, monkeypatch):
    """The partials are summed in split order, not finishing order: three calls give the same
    bits, and so does a captured call replayed twice (the counters are zero again after each)."""
    pytest.importorskip("triton")
    from ft.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "SPLIT_K", True)
    x, w = operands(4, n, k, seed=7)
    assert triton_gemv.plan(n, k, triton_gemv.splits_for(n, k, x.device)).splits > 1
    first = triton_gemv.gemv(x, w)
    for _ in range(2):
        assert torch.equal(triton_gemv.gemv(x, w), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemv.gemv(x, w)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
        assert not triton_gemv.tickets(x.device).any()
    x2, _ = operands(4, n, k, seed=8)
    x.copy_(x2)
    graph.replay()
    assert torch.equal(out, triton_gemv.gemv(x2, w))
