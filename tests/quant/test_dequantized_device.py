"""Where a quantised checkpoint weight held in float is dequantised (``ft.quant.dequantized``): on
the device it is asked for, the loader asking for the device of the parameter it loads (the CPU
for one on ``meta``), with the very bits the CPU computes; only the stored bytes of the rows or
columns read travel there. ``tensors_on`` and ``READS`` serve the CUDA twin of these tests
(``tests/gpu/test_dequantized_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import ft.models.loader
from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.checkpoint import CheckpointTensor, HeaderTensor
from ft.models.config_json import load_model_config
from ft.models.loader import load_weights
from ft.quant import nvfp4
from ft.quant.dequantized import Fp8BlockTensor, Nvfp4Tensor
from tests.quant.test_fp8_checkpoints import write_fp8_checkpoint

FP8_BLOCK = (16, 32)  # 37 rows = 16 + 16 + 5, 70 columns = 32 + 32 + 6: ragged last blocks
# (what, dim, start, length): whole, rows inside blocks, columns inside blocks (NVFP4's 16 wide)
READS = [("read", 0, 0, 0), ("rows", 0, 13, 22), ("columns", 1, 20, 45), ("empty", 1, 16, 0)]


def write_tensors(path) -> dict[str, torch.Tensor]:
    """A block-FP8 weight ``[37, 70]`` and an NVFP4 one ``[37, 96]`` with their scales, in ``path``;
    returns them. Scales and global are not powers of two, so the products round."""
    gen = torch.Generator().manual_seed(7)
    q = nvfp4.quantize(torch.randn(37, 96, generator=gen) * 3)
    tensors = {
        "fp8": (torch.randn(37, 70, generator=gen) * 40).to(torch.float8_e4m3fn),
        "fp8_scale": torch.rand(3, 3, generator=gen) + 0.3,
        "codes": q.weight,
        "scale": q.weight_scale,
        "global": q.weight_scale_2 * 1.37,
    }
    save_file(tensors, str(path))
    return tensors


def tensors_on(handle, device) -> dict[str, CheckpointTensor]:
    """The two weights of ``write_tensors``' file, read as float on ``device``."""

    def ckpt(name: str) -> CheckpointTensor:
        return CheckpointTensor(name, "f", handle)

    return {
        "fp8": Fp8BlockTensor(ckpt("fp8"), ckpt("fp8_scale"), FP8_BLOCK, device=device),
        "nvfp4": Nvfp4Tensor(ckpt("codes"), ckpt("scale"), ckpt("global"), device=device),
    }


def read(t: CheckpointTensor, dim: int, start: int, length: int, what: str) -> torch.Tensor:
    return t.read() if what == "read" else t.narrow(dim, start, length)


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 as its bits, on the CPU: -0.0 is not 0.0 here."""
    return t.detach().cpu().contiguous().view(torch.int32)


def test_dequantised_reads_land_on_the_device_asked_with_the_cpu_formulas_bits(tmp_path):
    """The formulas the loader always computed on the CPU, in their order: ``weight · scale`` per
    block for block-FP8, ``e2m1 · scale · global`` for NVFP4."""
    from safetensors import safe_open

    raw = write_tensors(tmp_path / "t.safetensors")
    bn, bk = FP8_BLOCK
    rows, cols = torch.arange(37), torch.arange(70)
    want = {
        "fp8": raw["fp8"].float() * raw["fp8_scale"][rows // bn][:, cols // bk],
        "nvfp4": nvfp4.dequantize(raw["codes"], raw["scale"], raw["global"]),
    }
    device = torch.device("cpu")
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as handle:
        for fmt, t in tensors_on(handle, device).items():
            for what, dim, start, length in READS:
                got = read(t, dim, start, length, what)
                assert got.device == device and got.dtype == torch.float32, (fmt, what)
                expected = want[fmt] if what == "read" else want[fmt].narrow(dim, start, length)
                assert torch.equal(bits(got), bits(expected)), (fmt, what)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_column_narrow_reads_only_the_blocks_that_hold_those_columns(tmp_path, fmt):
    """A row-parallel rank's columns: the stored bytes of whole blocks around them, no more (what
    travels to the device), for NVFP4 as for block-FP8."""
    from safetensors import safe_open

    write_tensors(tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as handle:
        t = tensors_on(handle, torch.device("cpu"))[fmt]
        stored = t._weight if fmt == "fp8" else t._codes
        asked, narrow = [], stored.narrow

        def counted(dim: int, start: int, length: int) -> torch.Tensor:
            asked.append((dim, start, length))
            return narrow(dim, start, length)

        stored.narrow = counted
        stored.read = lambda: pytest.fail("read whole for a narrow")
        t.narrow(1, 20, 45)  # NVFP4: blocks 1..4 of 16 inputs, code bytes 8..40
        assert asked == [(1, 20, 45)] if fmt == "fp8" else [(1, 8, 32)]


def test_the_loader_dequantises_on_each_parameters_device(tmp_path, monkeypatch):
    """Each dequantised weight is asked for on the device of the parameter that loads it; one on
    ``meta`` (an offloaded bank's, its experts in host rows and cache slots) on the CPU."""
    from ft.models.loader import dequantize_device

    write_fp8_checkpoint(tmp_path, "qwen3_moe", seed=33)
    path = str(tmp_path / "fp8")
    model = build_model(load_model_config(path), TPInfo(0, 1), "cpu", torch.float32)
    real, asked = ft.models.loader.dequantized.open_dequantized, []

    def spy(weight, *args, device):
        if not isinstance(weight, HeaderTensor):  # the loader's checks before it reads
            asked.append((weight.name, device))
        return real(weight, *args, device=device)

    monkeypatch.setattr(ft.models.loader.dequantized, "open_dequantized", spy)
    load_weights(model, path, progress=False)
    assert len(asked) == len(model.dequantized)
    assert {device for _, device in asked} == {torch.device("cpu")}
    assert dequantize_device(torch.empty(2, device="meta")) == torch.device("cpu")
    assert dequantize_device(torch.empty(2)) == torch.device("cpu")


def test_offloaded_experts_are_dequantised_where_the_model_runs(tmp_path):
    """An offloaded bank's experts live in host rows (and, lean, cache slots): their checkpoint's
    FP8 is dequantised on the device the model runs on (``dequantize_on``), not on the CPU that
    holds the rows, nor by the parameter's own device (``meta`` when lean)."""
    from ft.models.loader import dequantize_device
    from ft.moe.backends.placement import placed
    from ft.moe.backends.runtime import moe_blocks

    write_fp8_checkpoint(tmp_path, "qwen3_next", seed=34)
    options = dict(dtype="float32", moe_backend="offload", expert_cache_fraction=0.3, progress=False)
    with ft.LLM(model=str(tmp_path / "fp8"), device="cpu", **options) as llm:
        banks = [b.experts for b in moe_blocks(llm.engine.executor.runner.model)]
        homes = [(p, bank.device) for bank in banks for p in bank.parameters() if placed(p)]
        assert homes and all(p.dequantize_on == device for p, device in homes)
    lean = torch.nn.Parameter(torch.empty(2, device="meta"), requires_grad=False)
    lean.dequantize_on = torch.device("cuda", 1)
    assert dequantize_device(lean) == torch.device("cuda", 1)
