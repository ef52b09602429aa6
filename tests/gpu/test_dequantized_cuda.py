"""Quantised checkpoints held in float, loaded onto a GPU (``ft.quant.dequantized``): a block-FP8
checkpoint and a ModelOpt one with NVFP4 dense projections give, on CUDA, the very parameters and
greedy tokens of a float checkpoint of their dequantisation, resident and offloaded, and with
--quantize-experts nvfp4 (the bank quantises the same values); the weights, dequantised on the
GPU for a CUDA parameter, have the very bits of the CPU's, read whole, by rows and by columns.
The CPU tests check the maths; these the device paths (dequantising on CUDA, loaders copying
CUDA tensors into CUDA parameters and CPU ones into the host store's pinned views).
All 6 passed on an H200 on 2026-12-06 (2f27725: dequantised on the GPU, offloaded experts too)."""

from __future__ import annotations

import pytest
import torch

from ft import LLM, SamplingParams
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint
from tests.quant.test_dequantized_device import READS, bits, read, tensors_on, write_tensors
from tests.quant.test_fp8_checkpoints import PROMPTS, write_fp8_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def run(path, backend: str = "gpu", **options):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    if backend == "offload":
        options["expert_cache_fraction"] = 0.5
    with LLM(
        model=str(path), device="cuda", dtype="bfloat16", progress=False, moe_backend=backend, **options
    ) as llm:
        model = llm.engine.executor.runner.model
        # an offloaded bank's parameters are views of the cache and host store, or meta: the
        # tokens compare what they hold
        state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.device.type != "meta"}
        return [o.token_ids for o in llm.generate(PROMPTS, params)], state


@pytest.mark.parametrize("backend,experts", [("gpu", None), ("gpu", "nvfp4"), ("offload", None)])
def test_block_fp8_on_cuda_equals_its_dequantisation(tmp_path, backend, experts):
    write_fp8_checkpoint(tmp_path, "qwen3_next", seed=31)
    options = {"backend": backend} | ({"quantize_experts": experts} if experts else {})
    tokens, state = run(tmp_path / "fp8", **options)
    want_tokens, want_state = run(tmp_path / "dequant", **options)
    assert tokens == want_tokens
    for name, value in want_state.items():
        assert torch.equal(state[name], value), name


def test_nvfp4_dense_on_cuda_equals_its_dequantisation(tmp_path):
    write_nvfp4_checkpoint(tmp_path, "qwen3_next", seed=32, dense=True, moe_intermediate_size=64)
    _, state = run(tmp_path / "nvfp4")  # its experts NVFP4 as stored; the float twin's re-quantised
    _, want_state = run(tmp_path / "dequant", quantize_experts="nvfp4")  # (other globals: not compared)
    for name, value in want_state.items():
        if ".experts." not in name:
            assert torch.equal(state[name], value), name


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_dequantised_on_cuda_has_the_cpu_reads_bits(tmp_path, fmt):
    """fp32 products of the same numbers in the same order: the same bits on either device."""
    from safetensors import safe_open

    write_tensors(tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as handle:
        cpu = tensors_on(handle, torch.device("cpu"))[fmt]
        cuda = tensors_on(handle, torch.device("cuda"))[fmt]
        for what, dim, start, length in READS:
            got = read(cuda, dim, start, length, what)
            assert got.is_cuda and got.dtype == torch.float32, what
            assert torch.equal(bits(got), bits(read(cpu, dim, start, length, what))), what
