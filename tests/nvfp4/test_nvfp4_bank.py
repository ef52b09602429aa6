"""The NVFP4 expert bank: sharding along the intermediate axis, quantisation at load, strict
loading of ModelOpt tensors, the I/P rule, kernel selection and ``ft info`` sizes (all CPU)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft.cli import build_parser, engine_options, main
from ft.config import EngineConfig
from ft.distributed import TPInfo, tp_context
from ft.engine.build import build_model
from ft.models.checkpoint import CheckpointError
from ft.models.config_json import config_from_dict, load_model_config, load_raw_config
from ft.models.info import expert_bytes, footprint
from ft.models.loader import load_weights
from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref
from ft.moe.kernels.select import MOE_KERNELS, KernelSelectionError, select_moe_kernel
from ft.moe.nvfp4_bank import NVFP4ExpertBank
from tests.nvfp4.modelopt_ckpt import EXCLUDE, write_nvfp4_checkpoint

BANK = ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")
EXPERTS = "model.layers.{}.mlp.experts"
NEXT_80B = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3_next_80b_a3b.json")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    write_nvfp4_checkpoint(
        root, "qwen3_next", seed=7, moe_intermediate_size=64, linear_num_key_heads=4, linear_num_value_heads=8
    )
    return root


def rank_states(path, tp: int, expert_format: str | None = None) -> list[dict[str, torch.Tensor]]:
    mc = load_model_config(str(path))
    if expert_format:
        mc = dataclasses.replace(mc, expert_format=expert_format)
    states = []
    for r in range(tp):
        model = build_model(mc, TPInfo(r, tp), "cpu", torch.float32)
        load_weights(model, str(path), progress=False)
        states.append({k: _bits(v.detach().clone()) for k, v in model.state_dict().items()})
    return states


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # torch.equal has no fp8


@pytest.mark.parametrize("tp", [2, 4])
def test_slices_cover_the_intermediate_axis_once_and_reassemble(ckpt, tp):
    original = {k: _bits(v) for k, v in load_file(str(ckpt / "nvfp4" / "model.safetensors")).items()}
    mc = load_model_config(str(ckpt / "nvfp4"))
    states, whole = rank_states(ckpt / "nvfp4", tp), rank_states(ckpt / "nvfp4", 1)[0]
    local = mc.moe_intermediate_size // tp
    for layer in range(mc.num_layers):
        pre = EXPERTS.format(layer)
        parts = {n: [s[f"{pre}.{n}"] for s in states] for n in (*BANK, "input_scale")}
        assert sum(p.shape[1] for p in parts["w13"]) == 2 * mc.moe_intermediate_size
        for e in range(mc.num_experts):
            ck = f"{pre}.{e}"
            for i, proj in enumerate(("gate", "up")):  # rank r: rows [r·I/P, (r+1)·I/P) of each
                rows = slice(i * local, (i + 1) * local)
                for name, suffix in (("w13", "weight"), ("w13_scale", "weight_scale")):
                    got = torch.cat([p[e, rows] for p in parts[name]])
                    assert torch.equal(got, original[f"{ck}.{proj}_proj.{suffix}"]), (ck, proj, suffix)
                for p in parts["w13_global"]:
                    assert p[e, rows].eq(original[f"{ck}.{proj}_proj.weight_scale_2"]).all()
            # down: rank r holds packed columns [r·I/2P, ...) and scale columns [r·I/16P, ...)
            for name, suffix in (("w2", "weight"), ("w2_scale", "weight_scale")):
                got = torch.cat([p[e] for p in parts[name]], dim=1)
                assert torch.equal(got, original[f"{ck}.down_proj.{suffix}"]), (ck, suffix)
            for p in parts["w2_global"]:
                assert p[e].eq(original[f"{ck}.down_proj.weight_scale_2"]).all()
            inputs = [original[f"{ck}.{p}_proj.input_scale"] for p in ("gate", "up", "down")]
            for p in parts["input_scale"]:
                assert torch.equal(p[e], torch.stack(inputs))
        # and the slices are the TP=1 bank, split
        halves = [[p[:, :local], p[:, local:]] for p in parts["w13"]]
        w13 = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
        assert torch.equal(w13, whole[f"{pre}.w13"])
        assert torch.equal(torch.cat(parts["w2_scale"], dim=2), whole[f"{pre}.w2_scale"])
    w13_global = whole[f"{EXPERTS.format(0)}.w13_global"][0]
    gate_g, up_g = w13_global.split(mc.moe_intermediate_size)
    gate_g, up_g = gate_g.unique(), up_g.unique()
    assert len(gate_g) == len(up_g) == 1 and gate_g != up_g  # two globals in one w13, on purpose


def test_quantize_at_load_gives_the_modelopt_bytes_per_rank(ckpt):
    prequantised = rank_states(ckpt / "nvfp4", 2)
    at_load = rank_states(ckpt / "bf16", 2, expert_format="nvfp4")
    for got, want in zip(at_load, prequantised):
        for name, value in got.items():
            assert torch.equal(value, want[name]), name
        assert not any(k.endswith("input_scale") for k in got)  # no activation scales to keep


def test_bf16_shared_expert_and_dense_parts_load_as_before(ckpt):
    mc = load_model_config(str(ckpt / "nvfp4"))
    assert mc.expert_format == "nvfp4"
    assert mc.quantization.format_of("model.layers.0.mlp.shared_expert.gate_proj") == "bf16"
    model = build_model(mc, TPInfo(0, 1), "cpu", torch.float32)
    load_weights(model, str(ckpt / "nvfp4"), progress=False)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, NVFP4ExpertBank) and mlp.experts.kernel_name == "torch-nvfp4"
    original = load_file(str(ckpt / "nvfp4" / "model.safetensors"))
    gate_up = torch.cat(
        [original[f"model.layers.0.mlp.shared_expert.{p}_proj.weight"] for p in ("gate", "up")]
    )
    assert torch.equal(mlp.shared_expert.gate_up_proj.weight, gate_up)
    assert mlp.shared_expert.gate_up_proj.weight.dtype == torch.float32


def test_bf16_bank_refuses_an_nvfp4_checkpoint(ckpt):
    mc = dataclasses.replace(load_model_config(str(ckpt / "nvfp4")), expert_format="bf16")
    with pytest.raises(ValueError, match="stores these experts as nvfp4"):
        build_model(mc, TPInfo(0, 1), "meta", torch.float32)


def _corrupt(ckpt, tmp_path, edit, source="nvfp4", expert_format=None):
    dst = tmp_path / "bad"
    dst.mkdir()
    for f in ("config.json", "hf_quant_config.json"):
        if (ckpt / source / f).exists():
            (dst / f).write_text((ckpt / source / f).read_text())
    tensors = load_file(str(ckpt / source / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    mc = load_model_config(str(dst))
    mc = dataclasses.replace(mc, expert_format=expert_format or mc.expert_format)
    model = build_model(mc, TPInfo(0, 1), "cpu", torch.float32)
    return lambda: load_weights(model, str(dst), progress=False)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight_scale_2"), "missing tensor"),
        (lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.input_scale"), "down_proj.input_scale"),
        (
            lambda t: t.update({"model.layers.0.mlp.experts.2.gate_proj.weight_scale_2": torch.tensor(-1.0)}),
            ">= 0",
        ),
        (lambda t: t.update({"model.layers.0.mlp.experts.2.up_proj.input_scale": torch.ones(2)}), "scalar"),
        (
            lambda t: t.update({"model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(48, 32)}),
            "dtype torch.float32",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.mlp.experts.0.gate_proj.weight_scale": torch.zeros(64, 2).to(
                        torch.float8_e4m3fn
                    )
                }
            ),
            r"shape \[64, 2\], expected \[64, 3\]",
        ),
    ],
)
def test_strict_loading_names_the_bad_tensor(ckpt, tmp_path, edit, message):
    load = _corrupt(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load()


@pytest.mark.parametrize("value", [float("nan"), -2.0])
def test_a_nan_or_negative_block_scale_is_named(ckpt, tmp_path, value):
    name = "model.layers.1.mlp.experts.4.down_proj.weight_scale"

    def poison(tensors):
        scale = tensors[name].float()
        scale[5, 2] = value
        tensors[name] = scale.to(torch.float8_e4m3fn)

    with pytest.raises(CheckpointError, match=rf"'{re.escape(name)}' in .*bad.model\.safetensors.*>= 0"):
        _corrupt(ckpt, tmp_path, poison)()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_quantize_at_load_names_a_non_finite_expert(ckpt, tmp_path, value):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][7, 3] = value

    load = _corrupt(ckpt, tmp_path, poison, source="bf16", expert_format="nvfp4")
    where = rf"'{re.escape(name)}' in .*bad.model\.safetensors"
    with pytest.raises(CheckpointError, match=rf"{where}.*NaN or inf"):
        load()


def test_refuses_intermediate_per_rank_not_a_multiple_of_16(ckpt):
    with tp_context(TPInfo(0, 8)), torch.device("meta"), pytest.raises(ValueError, match="8 rows per rank"):
        NVFP4ExpertBank(8, 48, 64)  # 64 / 8 = 8
    mc = dataclasses.replace(load_model_config(str(ckpt / "nvfp4")), moe_intermediate_size=96)
    build_model(mc, TPInfo(0, 2), "meta", torch.float32)  # 48 per rank
    with pytest.raises(ValueError, match="gives 24 rows per rank.*multiple of 16"):
        build_model(mc, TPInfo(0, 4), "meta", torch.float32)
    with tp_context(TPInfo(1, 4)), torch.device("meta"):
        assert NVFP4ExpertBank(8, 48, 64).w2_scale.shape == (8, 48, 1)  # 16 per rank: one block


def test_a_hidden_size_off_the_16_grid_is_refused_without_blaming_the_tp_size():
    why = r"hidden_size 40 must be a multiple of 16.*at any tp size"
    with tp_context(TPInfo(0, 1)), torch.device("meta"), pytest.raises(ValueError, match=why):
        NVFP4ExpertBank(8, 40, 64)


def test_kernel_selection_for_nvfp4():
    name, kernel = select_moe_kernel("nvfp4", "cpu", tp_size=4, dtype=torch.float32)
    assert name == "torch-nvfp4" and kernel is fused_moe_nvfp4_ref
    with pytest.raises(KernelSelectionError) as err:
        select_moe_kernel("int4", "cpu", dtype=torch.bfloat16)
    for spec in MOE_KERNELS:  # every candidate, each with its reason
        assert f"  {spec.name}: format 'int4' not in" in str(err.value)
    gpu_only = tuple(s for s in MOE_KERNELS if s.name == "triton-w4a16")
    with pytest.raises(KernelSelectionError, match=r"triton-w4a16: device 'cpu' not in \('cuda',\)"):
        select_moe_kernel("nvfp4", "cpu", candidates=gpu_only)
    anywhere = dataclasses.replace(gpu_only[0], device_types=("any",), min_capability=None, needs=())
    assert "activation dtype torch.float32" in anywhere.refusal(
        "nvfp4", torch.device("cpu"), 1, torch.float32
    )
    assert anywhere.refusal("nvfp4", torch.device("cpu"), 2, torch.bfloat16) is None


def test_info_sizes_nvfp4_banks_packed(tmp_path):
    raw = load_raw_config(NEXT_80B)
    bf16, nvfp4 = (
        expert_bytes(config_from_dict(raw), 1, "bf16"),
        expert_bytes(config_from_dict(raw), 1, "nvfp4"),
    )
    assert bf16 == 512 * 48 * 3 * 512 * 2048 * 2
    assert 9 / 32 < nvfp4 / bf16 < 9 / 32 + 0.003  # codes + scales, plus fp32 globals per row
    declared = config_from_dict(
        raw | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": EXCLUDE}}
    )
    assert declared.expert_format == "nvfp4"
    for tp in (1, 8):
        fp = footprint(declared, tp)
        assert fp.bytes["experts"] == expert_bytes(declared, tp, "nvfp4")
        assert fp.shapes["model.layers.0.mlp.experts.w13"] == (512, 2 * 512 // tp, 1024)
        assert fp.shapes["model.layers.0.mlp.experts.w2_scale"] == (512, 2048, 512 // tp // 16)
    assert footprint(declared, 1).params["experts"] == 512 * 48 * 3 * 512 * 2048  # unpacked count
    assert main(["info", "--config", NEXT_80B, "--tp-size", "8", "--quantize-experts", "nvfp4"]) == 0


def test_quantize_experts_option(ckpt):
    args = build_parser().parse_args(
        ["generate", "--model", str(ckpt), "--prompt", "1", "--quantize-experts", "nvfp4"]
    )
    assert engine_options(args)["quantize_experts"] == "nvfp4"
    with pytest.raises(ValueError, match="quantize_experts"):
        EngineConfig(model=str(ckpt), quantize_experts="int4")


def test_first_layer_dense_and_excluded(tmp_path):
    """A dense layer 0 stays bf16 (listed in the exclusions); the experts after it are NVFP4."""
    import json

    write_nvfp4_checkpoint(tmp_path, "qwen3_moe", seed=3, mlp_only_layers=[0])
    declared = tmp_path / "nvfp4" / "hf_quant_config.json"
    body = json.loads(declared.read_text())
    body["quantization"]["exclude_modules"].append("model.layers.0.mlp*")
    declared.write_text(json.dumps(body))
    mc = load_model_config(str(tmp_path / "nvfp4"))
    assert mc.mlp_types[0] == "dense" and mc.expert_format == "nvfp4"
    model = build_model(mc, TPInfo(0, 1), "cpu", torch.float32)
    load_weights(model, str(tmp_path / "nvfp4"), progress=False)
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4ExpertBank)
