"""ModelConfig parsing: both rope forms, derived layer kinds, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from ft.models.config_json import load_model_config

SHARED = dict(  # what a tiny qwen3_moe and qwen3_next config have in common
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
NEXT = SHARED | dict(
    model_type="qwen3_next",
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def parse(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_model_config(str(tmp_path))


def test_old_top_level_rope_fields(tmp_path):
    mc = parse(tmp_path, NEXT | dict(rope_theta=5e6, partial_rotary_factor=0.5))
    assert (mc.rope_theta, mc.partial_rotary_factor, mc.rotary_dim) == (5e6, 0.5, 8)


def test_rope_parameters_form(tmp_path):
    raw = NEXT | dict(
        rope_parameters={"rope_type": "default", "rope_theta": 123.0, "partial_rotary_factor": 0.25}
    )
    mc = parse(tmp_path, raw)
    assert (mc.rope_theta, mc.rotary_dim) == (123.0, 4)


def test_layer_kinds(tmp_path):
    mc = parse(tmp_path, NEXT | dict(mlp_only_layers=[0], intermediate_size=64))
    assert mc.layer_types == ("linear_attention", "full_attention")
    assert mc.mlp_types == ("dense", "moe")
    assert mc.attention_layers == [1] and mc.linear_layers == [0]


def test_qwen3_moe_expert_alias(tmp_path):
    mc = parse(tmp_path, SHARED | dict(model_type="qwen3_moe", decoder_sparse_step=2))
    assert mc.num_experts == 4 and mc.mlp_types == ("dense", "moe")


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(layer_types=["linear_attention", "sliding"]), "layer_types"),
        (dict(layer_types=["linear_attention"]), "layer_types"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(model_type="llama9"), "model_type"),
    ],
)
def test_bad_fields_are_named(tmp_path, change, field):
    with pytest.raises(ValueError, match=field):
        parse(tmp_path, NEXT | change)


def test_generation_config_adds_stop_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    mc = parse(tmp_path, NEXT | dict(eos_token_id=7))
    assert mc.eos_token_ids == (7, 9)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "hf_quant_config.json"])
def test_malformed_json_names_the_file(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(NEXT))
    (tmp_path / name).write_text('{"eos_token_id": [1, 2}')
    with pytest.raises(ValueError, match=rf"{name}: not valid JSON"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"])
def test_missing_field_of_a_spec_family_is_named(tmp_path, field):
    from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config

    raw = {k: v for k, v in tiny_qwen4_exp_config().items() if k != field}
    with pytest.raises(ValueError, match=rf"config field {field}: required"):
        parse(tmp_path, raw)


def test_dense_layers_need_an_intermediate_size(tmp_path):
    with pytest.raises(ValueError, match=r"config field intermediate_size: .*layers \[0\] are dense"):
        parse(tmp_path, SHARED | dict(model_type="qwen3_moe", mlp_only_layers=[0], intermediate_size=0))


def test_truncated_checkpoint_read_for_a_config_fact_is_named(tmp_path):
    from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint

    raw = tiny_qwen4_exp_config()
    assert raw["ple_layers"]  # its table's row count is read from the checkpoint's header
    write_qwen4_exp_checkpoint(tmp_path, raw, seed=0)
    file = tmp_path / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize("raw", [NEXT | dict(model_type="llama9"), NEXT | dict(num_experts_per_tok=9)])
def test_a_field_error_names_the_file(tmp_path, raw):
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: config field"):
        parse(tmp_path, raw)


def test_a_file_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize(
    "field,value",
    [
        ("vocab_size", 0),
        ("hidden_size", -1),
        ("num_hidden_layers", 0),
        ("num_attention_heads", 0),
        ("head_dim", 0),
        ("max_position_embeddings", 0),
        ("num_key_value_heads", 0),  # was taken as absent: every head its own kv head
        ("num_hidden_layers", "4"),
    ],
)
def test_sizes_below_one_are_named(tmp_path, field, value):
    from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config

    raw = tiny_qwen4_exp_config() | {field: value}
    with pytest.raises(ValueError, match=rf"config field {field}: {value!r} must be a positive integer"):
        parse(tmp_path, raw)
