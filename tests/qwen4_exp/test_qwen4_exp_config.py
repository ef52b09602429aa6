"""qwen4_exp's config.json read per spec section 1: a field the spec lists but leaves without a
default takes Qwen3-Next's (the spec: "where this text is silent, follow Qwen3-Next as
implemented by Hugging Face transformers"), checked against transformers' own Qwen3NextConfig."""

from __future__ import annotations

import pytest
from transformers import Qwen3NextConfig

from ft.models.config_json import config_from_dict
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config

NEXT = Qwen3NextConfig()


def parsed_without(field: str, **overrides):
    raw = {k: v for k, v in tiny_qwen4_exp_config(**overrides).items() if k != field}
    return config_from_dict(raw | {"ple_table_rows": 1000})


def test_partial_rotary_factor_defaults_to_qwen3_next():
    mc = parsed_without("partial_rotary_factor")
    factor = NEXT.rope_parameters["partial_rotary_factor"]  # 0.25: a quarter of each head rotates
    assert mc.partial_rotary_factor == factor
    assert mc.rotary_dim == int(mc.head_dim * factor)


@pytest.mark.parametrize(
    "field,attr",
    [
        ("head_dim", "head_dim"),
        ("num_key_value_heads", "num_kv_heads"),
        ("num_experts", "num_experts"),
        ("num_experts_per_tok", "num_experts_per_tok"),
        ("moe_intermediate_size", "moe_intermediate_size"),
        ("shared_expert_intermediate_size", "shared_expert_intermediate_size"),
        ("rope_theta", "rope_theta"),
        ("rms_norm_eps", "rms_norm_eps"),
        ("norm_topk_prob", "norm_topk_prob"),
        ("tie_word_embeddings", "tie_word_embeddings"),
    ],
)
def test_absent_fields_take_qwen3_next_defaults(field, attr):
    mc = parsed_without(field, num_experts=16)  # 16 experts: room for Qwen3-Next's top-10
    expected = NEXT.rope_parameters["rope_theta"] if field == "rope_theta" else getattr(NEXT, field)
    assert getattr(mc, attr) == expected
    if field == "num_experts":
        assert set(mc.mlp_types) == {"moe"}  # every qwen4_exp layer has an MoE sublayer (section 3)


@pytest.mark.parametrize(
    "field",
    [
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    ],
)
def test_absent_gdn_fields_take_qwen3_next_defaults(field):
    """Section 1 lists the GDN sizes without a default and without "(required)", as it lists
    head_dim: absent, each is Qwen3-Next's."""
    mc = parsed_without(field, linear_num_value_heads=32)  # 32: a multiple of Qwen3-Next's 16 key heads
    assert getattr(mc, field) == getattr(NEXT, field)
