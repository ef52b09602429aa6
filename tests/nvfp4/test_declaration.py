"""What a ModelOpt NVFP4 declaration makes of each module of the Qwen3 families: the exclude
patterns decide; a dense projection, router or lm_head declared NVFP4 is built in float and
noted for the loader to dequantise (``ft.quant.dequantized``), as is a block-FP8 one; experts in
two formats are refused when the model is built, naming the module (all CPU, on meta)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.config import ModelConfig
from ft.models.config_json import load_model_config
from ft.quant.declaration import parse_declaration
from ft.quant.dequantized import Dequantize
from tests.checkpoints import QWEN3_MOE_BASE, QWEN3_NEXT_BASE
from tests.nvfp4.modelopt_ckpt import EXCLUDE


def config(tmp_path, model_type: str, exclude: list[str]) -> ModelConfig:
    """The config of a tiny ``model_type`` checkpoint declaring its NVFP4 modules by ``exclude``."""
    base = {"qwen3_moe": QWEN3_MOE_BASE, "qwen3_next": QWEN3_NEXT_BASE}[model_type]
    declaration = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": exclude}
    body = base | {"model_type": model_type, "quantization_config": declaration}
    (tmp_path / "config.json").write_text(json.dumps(body))
    return load_model_config(str(tmp_path))


def build(mc: ModelConfig) -> torch.nn.Module:
    return build_model(mc, TPInfo(0, 1), "meta", torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize(
    "kept,noted",
    [
        ("model.layers.*.self_attn*", r"model\.layers\.\d\.self_attn\.[qkvo]_proj"),
        ("lm_head", r"lm_head"),
        ("model.layers.*.mlp.gate", r"model\.layers\.\d\.mlp\.gate"),
    ],
)
def test_dense_modules_declared_nvfp4_build_in_float_for_the_loader_to_dequantise(
    tmp_path, model_type, kept, noted
):
    assert not build(config(tmp_path, model_type, EXCLUDE)).dequantized  # the experts only: read as NVFP4
    model = build(config(tmp_path, model_type, [p for p in EXCLUDE if p != kept]))
    got = model.dequantized
    assert got and all(re.fullmatch(noted, m) and h.format == "nvfp4" for m, h in got.items()), got
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".experts." not in n)


def test_gdn_and_shared_expert_declared_nvfp4_are_noted_by_checkpoint_part(tmp_path):
    for kept, module in (
        (
            "model.layers.*.linear_attn*",
            r"model\.layers\.[02]\.linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)",
        ),
        ("model.layers.*.mlp.shared_expert*", r"model\.layers\.\d\.mlp\.shared_expert(\.\w+_proj|_gate)"),
    ):
        noted = build(config(tmp_path, "qwen3_next", [p for p in EXCLUDE if p != kept])).dequantized
        assert noted and all(re.fullmatch(module, m) for m in noted), noted


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_block_fp8_modules_are_noted_with_their_block(tmp_path, model_type):
    """These families have no block-FP8 twins (GDN's in_proj reorders its rows as it loads): their
    FP8 dense projections and experts load dequantised, each noted with the declared block."""
    base = {"qwen3_moe": QWEN3_MOE_BASE, "qwen3_next": QWEN3_NEXT_BASE}[model_type]
    fp8 = {"quant_method": "fp8", "weight_block_size": [64, 32], "ignored_layers": ["lm_head", "*.mlp.gate"]}
    body = base | {"model_type": model_type, "quantization_config": fp8}
    (tmp_path / "config.json").write_text(json.dumps(body))
    mc = load_model_config(str(tmp_path))
    assert mc.expert_format == "bf16"  # the bank a block-FP8 checkpoint fills
    noted = build(mc).dequantized
    assert {h for h in noted.values()} == {Dequantize("fp8_block", (64, 32))}
    assert "model.layers.1.mlp.experts.0.down_proj" in noted and "lm_head" not in noted
    assert "model.layers.1.self_attn.o_proj" in noted
    bad = fp8 | {"weight_block_size": [64]}
    (tmp_path / "config.json").write_text(json.dumps(body | {"quantization_config": bad}))
    with pytest.raises(ValueError, match=r"\(tp_size 1\): fp8 weight_block_size \(64,\) must be two"):
        build(load_model_config(str(tmp_path)))


@pytest.mark.parametrize(
    "kept,example",
    [
        (
            "model.layers.0.mlp.experts*",
            r"layers\.1\.mlp\.experts\.0\.gate_proj nvfp4.*layers\.0\.mlp\.experts",
        ),
        (
            "model.layers.2.mlp.experts*",
            r"layers\.0\.mlp\.experts\.0\.gate_proj nvfp4.*layers\.2\.mlp\.experts",
        ),
        ("*.down_proj", r"experts\.0\.gate_proj nvfp4.*experts\.0\.down_proj bf16"),
    ],
)
def test_experts_declared_in_two_formats_are_refused(tmp_path, kept, example):
    """One bank format serves every layer: a bf16 layer was quantised at load unasked (or, were it
    the first, refused by the next layer's bank as if the engine had asked for bf16)."""
    with pytest.raises(ValueError, match=rf"config\.json: routed experts.*{example}"):
        config(tmp_path, "qwen3_moe", EXCLUDE + [kept])


def test_a_quantised_kv_cache_is_named_and_left_unused():
    nvfp4 = {"quant_algo": "NVFP4", "exclude_modules": EXCLUDE}
    assert parse_declaration(None, {"quantization": nvfp4 | {"kv_cache_quant_algo": None}}).kv_cache is None
    fp8 = parse_declaration(None, {"quantization": nvfp4 | {"kv_cache_quant_algo": "FP8"}})
    assert fp8.algo == "NVFP4" and fp8.kv_cache == "kv_cache_quant_algo='FP8'"
    scheme = {"dynamic": False, "num_bits": 8, "type": "float"}
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": EXCLUDE, "kv_cache_scheme": scheme}
    assert parse_declaration(qc, None).kv_cache.startswith("kv_cache_scheme=")
    # config.json's quantization_config may name it beside an hf_quant_config.json that does not
    assert parse_declaration(qc, {"quantization": nvfp4}).kv_cache.startswith("kv_cache_scheme=")


def test_a_checkpoint_with_fp8_kv_scales_loads_them_unused(tmp_path):
    """ModelOpt's NVFP4 exports often declare an FP8 KV cache and carry k/v scales: the checkpoint
    loads, its KV cache in the model's dtype, the scales skipped, the outputs those of the same
    checkpoint without them (they were refused as unexpected tensors before)."""
    from safetensors.torch import load_file, save_file

    from ft import LLM, SamplingParams
    from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint

    write_nvfp4_checkpoint(tmp_path, "qwen3_next", seed=5, moe_intermediate_size=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True)

    def run():
        with LLM(model=str(tmp_path / "nvfp4"), device="cpu", dtype="float32", progress=False) as llm:
            return llm.generate([[5, 17, 3, 88, 41, 9]], params)[0]

    want = run()
    path = tmp_path / "nvfp4" / "model.safetensors"
    tensors = load_file(str(path))
    attn = sorted({n.rsplit(".", 2)[0] for n in tensors if ".self_attn.k_proj." in n})
    assert attn  # the tiny Qwen3-Next has full-attention layers
    for stem in attn:  # e.g. model.layers.3.self_attn: ModelOpt's names, and a shorter form
        tensors[f"{stem}.k_proj.k_scale"] = torch.tensor(0.05)
        tensors[f"{stem}.v_proj.v_scale"] = torch.tensor(0.07)
        tensors[f"{stem}.kv_scale"] = torch.tensor(0.06)
        tensors[f"{stem}.q_scale"] = torch.tensor(0.04)  # an FP8 attention's, beside them
        tensors[f"{stem}.prob_scale"] = torch.tensor(0.03)
    save_file(tensors, str(path))
    declaration = json.loads((tmp_path / "nvfp4" / "hf_quant_config.json").read_text())
    declaration["quantization"]["kv_cache_quant_algo"] = "FP8"
    (tmp_path / "nvfp4" / "hf_quant_config.json").write_text(json.dumps(declaration))
    got = run()
    assert got.token_ids == want.token_ids and got.prompt_logprobs == want.prompt_logprobs
