"""The Triton W4A16 fused MoE equals the NVFP4 torch reference on the GPU (marker ``gpu``):
Qwen3-Next's shape (512 experts, H=2048, I=512, top-10) at decode and 4k-token prefill sizes,
tensor-parallel shards (including an I whose K tail is not a whole tile), ModelOpt-quantised
weights with gate and up globals apart, and the bank's kernel choice."""

from __future__ import annotations

import pytest
import torch

from ft.quant import nvfp4
from ft.quant.nvfp4 import NVFP4Tensor

pytestmark = pytest.mark.gpu


def random_bank(e: int, n: int, k: int, gen: torch.Generator) -> NVFP4Tensor:
    """Random codes, fp8 scales and per-row globals, scaled so that rows have norm ~1, on the
    generator's device."""
    dev = gen.device
    codes = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=dev, dtype=torch.uint8)
    scales = (torch.rand(e, n, k // 16, generator=gen, device=dev) * 447 + 1).to(torch.float8_e4m3fn)
    # |e2m1| has rms ~2.9, the scales ~260: globals near k^-0.5 / 760, varying per row
    globals_ = (torch.rand(e, n, generator=gen, device=dev) + 0.5) * k**-0.5 / 760
    return NVFP4Tensor(codes, scales, globals_)


def routing(t: int, e: int, topk: int, gen: torch.Generator):
    logits = torch.randn(t, e, generator=gen, device="cuda")
    weights, ids = torch.softmax(logits, -1).topk(topk, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def off_then_on(monkeypatch, switch: str, call) -> list[torch.Tensor]:
    """``call()``'s output (fp32) with ``triton_w4a16.<switch>`` off, then on."""
    from ft.moe.kernels import triton_w4a16

    outs = []
    for on in (False, True):
        monkeypatch.setattr(triton_w4a16, switch, on)
        outs.append(call().float())
    return outs


def check(t: int, e: int, inter: int, h: int, topk: int, seed: int = 0, w13=None, w2=None) -> None:
    pytest.importorskip("triton")
    from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref
    from ft.moe.kernels.triton_w4a16 import fused_moe_w4a16

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = w13 if w13 is not None else random_bank(e, 2 * inter, h, gen)
    w2 = w2 if w2 is not None else random_bank(e, h, inter, gen)
    x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, e, topk, gen)
    got = fused_moe_w4a16(x, w13, w2, weights, ids)
    ref = fused_moe_nvfp4_ref(x.float(), w13, w2, weights, ids)
    assert got.shape == (t, h) and got.dtype == torch.bfloat16
    err = rel_err(got, ref)
    assert err < 2e-2, f"T={t} E={e} I={inter} H={h}: relative error {err:.3g}"


@pytest.mark.parametrize("t", [1, 4, 16, 64, 4096])
def test_qwen3_next_shape(t):
    check(t, 512, 512, 2048, 10)


@pytest.mark.parametrize("inter,t", [(256, 3), (128, 300), (64, 17), (48, 33)])
def test_tp_shards_and_k_tails(inter, t):
    check(t, 512, inter, 2048, 10, seed=inter)


def test_dequantize_bank_gives_the_reference_bits():
    """``dequantize_bank`` (one launch) equals ``nvfp4.dequantize`` in bf16 bit for bit, at
    Qwen3-Next's gate/up and down shapes and at an I with row and input tails."""
    from ft.moe.kernels.w4a16_dequantize import dequantize_bank

    gen = torch.Generator(device="cuda").manual_seed(6)
    for e, n, k in ((512, 1024, 2048), (512, 2048, 512), (5, 80, 48)):
        w = random_bank(e, n, k, gen)
        want = nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2, torch.bfloat16)
        assert torch.equal(dequantize_bank(w), want), (e, n, k)


@pytest.mark.parametrize("lut", [False, True])
@pytest.mark.parametrize("t,inter", [(1, 512), (17, 512), (64, 512), (300, 128), (4096, 512), (33, 48)])
def test_mma_tiles_both_decodes(t, inter, lut, monkeypatch):
    """The MMA path at every size (the GEMV off), its codes decoded byte by byte and by PTX byte
    tables (``LUT``)."""
    from ft.moe.kernels import triton_w4a16

    monkeypatch.setattr(triton_w4a16, "GEMV_MAX_TOKENS", 0)
    monkeypatch.setattr(triton_w4a16, "LUT", lut)
    check(t, 512, inter, 2048, 10, seed=t)


@pytest.mark.parametrize("t", [64, 4096])
def test_lut_decode_matches_the_byte_decode(t, monkeypatch):
    """``LUT`` against the byte decode on the same call: each value is the same (the kernels differ
    only in the order of a K step's products), so the outputs agree to a few bf16 steps."""
    from ft.moe.kernels import triton_w4a16

    monkeypatch.setattr(triton_w4a16, "GEMV_MAX_TOKENS", 0)
    gen = torch.Generator(device="cuda").manual_seed(9)
    w13, w2 = random_bank(512, 1024, 2048, gen), random_bank(512, 2048, 512, gen)
    x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, 512, 10, gen)
    outs = off_then_on(monkeypatch, "LUT", lambda: triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids))
    assert rel_err(outs[1], outs[0]) < 5e-3, rel_err(outs[1], outs[0])


@pytest.mark.parametrize("t", [1, 40])
def test_modelopt_quantised_experts(t):
    gen = torch.Generator(device="cuda").manual_seed(5)
    e, inter, h = 8, 128, 256
    w13, w2 = [], []
    for _ in range(e):
        gate = nvfp4.quantize(torch.randn(inter, h, generator=gen, device="cuda") * 0.02)
        up = nvfp4.quantize(torch.randn(inter, h, generator=gen, device="cuda") * 0.3)
        down = nvfp4.quantize(torch.randn(h, inter, generator=gen, device="cuda") * 0.05)
        globals_ = torch.cat([gate.weight_scale_2.expand(inter), up.weight_scale_2.expand(inter)])
        w13.append(
            (torch.cat([gate.weight, up.weight]), torch.cat([gate.weight_scale, up.weight_scale]), globals_)
        )
        w2.append((down.weight, down.weight_scale, down.weight_scale_2.expand(h)))
    stack = [NVFP4Tensor(*(torch.stack(parts) for parts in zip(*w))) for w in (w13, w2)]
    check(t, e, inter, h, 2, seed=t, w13=stack[0], w2=stack[1])


def test_bank_selects_triton_for_bf16_and_the_reference_for_fp32():
    pytest.importorskip("triton")
    from ft.distributed import TPInfo, tp_context
    from ft.moe.nvfp4_bank import NVFP4ExpertBank

    previous = torch.get_default_dtype()
    try:
        for dtype, name in ((torch.bfloat16, "triton-w4a16"), (torch.float32, "torch-nvfp4")):
            torch.set_default_dtype(dtype)
            with tp_context(TPInfo(0, 2)), torch.device("cuda"):
                assert NVFP4ExpertBank(4, 64, 64).kernel_name == name
    finally:
        torch.set_default_dtype(previous)


def test_engine_on_cuda_with_nvfp4_experts(tmp_path):
    pytest.importorskip("triton")
    from ft import LLM, SamplingParams
    from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint

    write_nvfp4_checkpoint(tmp_path, "qwen3_moe", seed=2, moe_intermediate_size=64)
    prompts = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        # the backend named: "auto" weighs the model against free memory, which the kernel tests
        # beside it take (run_gpu_tests.sh runs them in parallel)
        kw = dict(device=device, dtype=dtype, progress=False, num_tokens=2048, moe_backend="gpu")
        llm = LLM(model=str(tmp_path / "nvfp4"), **kw)
        with llm:
            outs[device] = llm.generate(prompts, params)
            if device == "cuda":
                assert (
                    llm.engine.executor.runner.model.model.layers[0].mlp.experts.kernel_name == "triton-w4a16"
                )
    for got, want in zip(outs["cuda"], outs["cpu"]):
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            tok = next(t for t in w if t in g)  # the prompt token is in both
            assert abs(g[tok] - w[tok]) < 0.1 + 0.02 * abs(w[tok])


@pytest.mark.parametrize("t", [1024, 4096, 8192])
def test_gluon_kernel_matches_the_triton_kernel(t, monkeypatch):
    """``GLUON`` (the Gluon kernel whose decoding overlaps the wgmmas) against the Triton kernel
    with the same table decode on the same call, and against the reference: the same values,
    products summed in another order within a K step, so a few bf16 steps apart."""
    from ft.moe.kernels import gluon_w4a16, triton_w4a16
    from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref

    monkeypatch.setattr(triton_w4a16, "LUT", True)
    gen = torch.Generator(device="cuda").manual_seed(t)
    w13, w2 = random_bank(512, 1024, 2048, gen), random_bank(512, 2048, 512, gen)
    assert gluon_w4a16.supports(w13, w2)
    x = torch.randn(t, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, 512, 10, gen)
    outs = off_then_on(monkeypatch, "GLUON", lambda: triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids))
    assert rel_err(outs[1], outs[0]) < 5e-3, rel_err(outs[1], outs[0])
    ref = fused_moe_nvfp4_ref(x.float(), w13, w2, weights, ids)
    assert rel_err(outs[1], ref) < 2e-2, rel_err(outs[1], ref)


def test_gluon_kernel_into_rows(monkeypatch):
    """The Gluon kernel through ``Into`` (the offload backend's calls: one expert a pair, tokens
    are rows of a larger batch, terms go to rows of another tensor) gives the Triton kernel's terms."""
    from ft.moe.kernels import gluon_w4a16, triton_w4a16
    from ft.moe.kernels.into import Into

    monkeypatch.setattr(triton_w4a16, "LUT", True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    p, h = 6000, 2048
    w13, w2 = random_bank(64, 1024, h, gen), random_bank(64, h, 512, gen)
    assert gluon_w4a16.supports(w13, w2)
    x = torch.randn(p // 2, h, generator=gen, device="cuda").to(torch.bfloat16)
    tokens = torch.randint(0, p // 2, (p,), generator=gen, device="cuda")
    weights, ids = routing(p, 64, 1, gen)
    rows = torch.randperm(p + 100, generator=gen, device="cuda")[:p]

    def call():
        into = Into(tokens, torch.zeros(p + 100, h, device="cuda", dtype=torch.bfloat16), rows)
        return triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids, into=into)

    outs = off_then_on(monkeypatch, "GLUON", call)
    assert outs[0].abs().sum() > 0
    assert rel_err(outs[1], outs[0]) < 5e-3, rel_err(outs[1], outs[0])


@pytest.mark.parametrize("t", [1024, 4096])
def test_gluon_kernel_small_banks(t, monkeypatch):
    """The Gluon kernel on a 128-expert bank (the ``E128`` rows) with H = I = 256, its smallest
    aligned K (four steps): the Triton kernel's values."""
    from ft.moe.kernels import gluon_w4a16, triton_w4a16

    monkeypatch.setattr(triton_w4a16, "LUT", True)
    gen = torch.Generator(device="cuda").manual_seed(t + 1)
    w13, w2 = random_bank(128, 512, 256, gen), random_bank(128, 256, 256, gen)
    assert gluon_w4a16.supports(w13, w2)  # (else both calls would run the Triton kernel)
    x = torch.randn(t, 256, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, 128, 8, gen)
    outs = off_then_on(monkeypatch, "GLUON", lambda: triton_w4a16.fused_moe_w4a16(x, w13, w2, weights, ids))
    assert rel_err(outs[1], outs[0]) < 5e-3, rel_err(outs[1], outs[0])
