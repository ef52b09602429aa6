"""The qwen4_exp model at the spec's reference dimensions (configs/qwen4_exp_flash_next.json,
spec section 10) builds on the meta device, and ``ft info`` prints its per-rank bytes."""

from __future__ import annotations

import os
import resource

from ft.cli import main
from ft.models.config_json import load_model_config
from ft.models.info import footprint

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen4_exp_flash_next.json")
GIB = 1024**3


def test_reference_dimensions_build_on_meta_with_per_rank_shapes():
    mc = load_model_config(CONFIG)
    assert (len(mc.attention_layers), len(mc.linear_layers)) == (12, 36)
    assert mc.ple_table_rows == 2 * 2 * 8 * 2**21  # no checkpoint: primes near 2^21 (spec)
    whole = footprint(mc, 1)
    assert whole.params["experts"] == 512 * 48 * 3 * 640 * 3072
    table = whole.shapes["model.ple.table"]
    assert table == (2**26, 64) and table[0] * table[1] * 2 == 8 * GIB  # "about 8 GiB in bf16"
    for tp in (2, 4, 8):
        fp = footprint(mc, tp)
        s = fp.shapes
        assert fp.bytes["experts"] * tp == whole.bytes["experts"]
        assert s["model.layers.0.mlp.experts.w13"] == (512, 2 * 640 // tp, 3072)
        assert s["model.layers.0.mlp.experts.w2"] == (512, 3072, 640 // tp)
        assert s["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == (2 * 640 // tp, 3072)
        assert s["model.layers.0.linear_attn.in_proj.weight"] == ((2 * 2048 + 2 * 4096 + 2 * 32) // tp, 3072)
        assert s["model.layers.0.linear_attn.conv1d.weight"] == (8192 // tp, 1, 4)
        kv_rows = max(1, 4 // tp) * 256  # 4 kv heads: replicated at tp 8
        assert s["model.layers.3.self_attn.qkv_proj.weight"] == (24 // tp * 512 + 2 * kv_rows, 3072)
        assert s["model.layers.3.self_attn.indexer.q_proj.weight"] == (4 * 128, 3072)  # replicated
        assert s["model.layers.0.hc_mixer.fn"] == (24, 4 * 3072) and s["model.ple.table"] == table
    assert footprint(mc, 2).shapes["model.layers.0.mlp.experts.w2"][2] == 320  # I=640 -> 320 per rank


def test_cli_info_prints_per_rank_bytes(capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["info", "--config", CONFIG, "--tp-size", "1,2,4,8"]) == 0
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / GIB
    out = capsys.readouterr().out
    assert "model_type: qwen4_exp" in out
    for tp in (1, 2, 4, 8):
        assert f"tp_size {tp}: weight bytes per rank" in out
        assert f"  rank {tp - 1}: dense" in out
    assert "experts  135.000 GiB" in out  # 270 GiB of bf16 experts, halved at tp 2
    assert grown_gib < 2  # a 285 GiB model never materialised
