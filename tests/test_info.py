"""``ft info`` on the real Qwen3-Next-80B-A3B and Qwen3-30B-A3B configs: per-rank shapes and
bytes for tp 1/2/4/8, built on the meta device without allocating weights."""

from __future__ import annotations

import dataclasses
import os
import resource

import pytest

from ft.cli import main
from ft.models.config_json import load_model_config
from ft.models.info import footprint, format_info

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
NEXT = os.path.join(CONFIGS, "qwen3_next_80b_a3b.json")
MOE = os.path.join(CONFIGS, "qwen3_30b_a3b.json")
GIB = 1024**3


def test_qwen3_next_per_rank_shapes_and_bytes():
    mc = load_model_config(NEXT)
    whole = footprint(mc, 1)
    # 512 experts x 48 layers x 3 x 512 x 2048 parameters, bf16
    assert whole.params["experts"] == 512 * 48 * 3 * 512 * 2048
    assert whole.bytes["experts"] == 2 * whole.params["experts"]
    assert 79e9 < sum(whole.params.values()) < 81e9
    for tp in (2, 4, 8):
        fp = footprint(mc, tp)
        assert fp.bytes["experts"] * tp == whole.bytes["experts"]
        s = fp.shapes
        assert s["model.layers.0.mlp.experts.w13"] == (512, 2 * 512 // tp, 2048)
        assert s["model.layers.0.mlp.experts.w2"] == (512, 2048, 512 // tp)
        assert s["model.layers.0.linear_attn.in_proj.weight"] == ((12288 + 64) // tp, 2048)  # qkvz + ba
        assert s["model.layers.0.linear_attn.conv1d.weight"] == (8192 // tp, 1, 4)
        assert s["model.layers.0.linear_attn.A_log"] == (32 // tp,)
        kv_rows = max(1, 2 // tp) * 256
        assert s["model.layers.3.self_attn.qkv_proj.weight"] == (16 // tp * 512 + 2 * kv_rows, 2048)
        assert s["model.embed_tokens.weight"] == (151936 // tp, 2048)


def test_qwen3_30b_per_rank_bytes():
    mc = load_model_config(MOE)
    whole = footprint(mc, 1)
    assert whole.params["experts"] == 128 * 48 * 3 * 768 * 2048
    assert 30e9 < sum(whole.params.values()) < 31e9
    fp8 = footprint(mc, 8)
    assert fp8.shapes["model.layers.0.self_attn.qkv_proj.weight"] == (4 * 128 + 2 * 128, 2048)
    assert fp8.bytes["experts"] * 8 == whole.bytes["experts"]


@pytest.mark.parametrize("config", [NEXT, MOE])
def test_cli_info_touches_no_weight_memory(capsys, config):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["info", "--config", config, "--tp-size", "1,2,4,8"]) == 0
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / GIB
    out = capsys.readouterr().out
    for tp in (1, 2, 4, 8):
        assert f"tp_size {tp}: weight bytes per rank" in out
        assert f"  rank {tp - 1}: dense" in out
    assert "experts" in out and grown_gib < 2  # a 60-160 GB model never materialised


def test_info_says_which_quantised_modules_load_dequantised(tmp_path):
    """A block-FP8 checkpoint (Qwen's releases) is held in float: ft info says how many modules of
    each kind load dequantised, beside byte figures that are the float ones."""
    from tests.quant.test_fp8_checkpoints import write_fp8_checkpoint

    write_fp8_checkpoint(tmp_path, "qwen3_moe", seed=1)
    out = format_info(load_model_config(str(tmp_path / "fp8")), [1])
    mc = load_model_config(str(tmp_path / "fp8"))
    projections = 3 * mc.num_experts * mc.mlp_types.count("moe")
    assert f"{projections:,} expert projections fp8_block -> {mc.dtype}" in out
    assert f"dense modules fp8_block -> {mc.dtype}" in out and "dequantised as they load" in out
    nvfp4 = format_info(dataclasses.replace(mc, expert_format="nvfp4"), [1])  # --quantize-experts nvfp4
    assert f"{projections:,} expert projections fp8_block -> NVFP4" in nvfp4
    assert "dequantised" not in format_info(load_model_config(str(tmp_path / "dequant")), [1])


def test_the_nvfp4_experts_line_is_what_a_rank_holds_in_nvfp4(tmp_path):
    """`experts per rank: nvfp4` is what one rank's experts take stored as NVFP4: the experts of
    the model --quantize-experts nvfp4 builds (no activation scales: quantised at load), and a
    ModelOpt checkpoint's own (its input_scale too). It counted a ModelOpt bank for both, so the
    80B's line read 40.782 GiB under its rank's 40.781."""
    from ft.models.info import expert_bytes
    from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint

    mc = dataclasses.replace(load_model_config(NEXT), expert_format="nvfp4")
    for tp in (1, 2, 4, 8):
        assert expert_bytes(mc, tp, "nvfp4") == footprint(mc, tp).bytes["experts"]
    write_nvfp4_checkpoint(tmp_path, "qwen3_next", seed=1)
    modelopt = load_model_config(str(tmp_path / "nvfp4"))
    assert modelopt.expert_format == "nvfp4"
    assert expert_bytes(modelopt, 1, "nvfp4") == footprint(modelopt, 1).bytes["experts"]
