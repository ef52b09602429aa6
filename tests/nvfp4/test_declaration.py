"""What a ModelOpt NVFP4 declaration makes of each module of the Qwen3 families: the exclude
patterns decide, and whatever is declared NVFP4 but cannot run that way (a dense projection, a
router, lm_head) is refused when the model is built, naming the module (all CPU, on meta)."""

from __future__ import annotations

import json

import pytest
import torch

from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.config import ModelConfig
from ft.models.config_json import load_model_config
from ft.quant.declaration import parse_declaration
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
    "kept,refusal",
    [
        (
            "model.layers.*.self_attn*",
            r"model\.layers\.\d\.self_attn\.(qkv|o)_proj \(tp_size 1\): dense nvfp4",
        ),
        ("lm_head", r"lm_head \(tp_size 1\): dense nvfp4"),
        ("model.layers.*.mlp.gate", r"model\.layers\.\d\.mlp\.gate \(tp_size 1\)"),
    ],
)
def test_quantised_dense_modules_are_refused_by_name(tmp_path, model_type, kept, refusal):
    build(config(tmp_path, model_type, EXCLUDE))  # the declaration the tests load: experts only
    with pytest.raises(ValueError, match=refusal):
        build(config(tmp_path, model_type, [p for p in EXCLUDE if p != kept]))


def test_quantised_gdn_and_shared_expert_are_refused_by_name(tmp_path):
    for kept, module in (
        ("model.layers.*.linear_attn*", r"model\.layers\.[02]\.linear_attn\.\w+_proj"),
        ("model.layers.*.mlp.shared_expert*", r"model\.layers\.\d\.mlp\.(shared_expert\.\w+_proj|gate)"),
    ):
        with pytest.raises(ValueError, match=module):
            build(config(tmp_path, "qwen3_next", [p for p in EXCLUDE if p != kept]))


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


def test_kv_cache_quantisation_is_refused(tmp_path):
    nvfp4 = {"quant_algo": "NVFP4", "exclude_modules": EXCLUDE}
    assert parse_declaration(None, {"quantization": nvfp4 | {"kv_cache_quant_algo": None}}).algo == "NVFP4"
    with pytest.raises(ValueError, match=r"kv_cache_quant_algo: 'FP8' is not supported"):
        parse_declaration(None, {"quantization": nvfp4 | {"kv_cache_quant_algo": "FP8"}})
    body = QWEN3_MOE_BASE | {"model_type": "qwen3_moe"}
    body["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": EXCLUDE}
    body["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    (tmp_path / "config.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"config\.json: .*kv_cache_scheme: .* is not supported"):
        load_model_config(str(tmp_path))
