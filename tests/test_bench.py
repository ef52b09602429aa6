"""``ft bench offline`` runs end to end on CPU with a tiny config (so it cannot rot), and the
roofline counts the bytes a decode step must move."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ft.bench.roofline import decode_step_bytes
from ft.cli import main
from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.config_json import load_model_config
from tests.checkpoints import write_checkpoint


def test_bench_offline_cli(tmp_path, capsys):
    write_checkpoint(tmp_path, "qwen3_next")
    out_json = tmp_path / "bench.json"
    argv = [
        "bench",
        "offline",
        "--config",
        str(tmp_path / "config.json"),
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,3",
        "--input-len",
        "12",
        "--output-len",
        "5",
        "--prefill-lens",
        "24",
        "--ttft-idle-s",
        "0.01",
        "--output-json",
        str(out_json),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "single-stream decode" in printed and "achieved/roof" in printed
    assert ", each after 0.01 s idle" in printed
    report = json.loads(out_json.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    assert all(r["decode_tok_s"] > 0 and r["roofline_tok_s"] > 0 for r in report["rows"])
    assert report["prefill"]["24"] > 0 and report["ttft_ms"] > 0
    # each prompt beside its compute floor: its FLOPs over the matmul rate measured on the device
    floors = report["compute_floor_s"]
    assert report["matmul_tflops"] > 0 and 0 < floors["12"] < floors["24"]
    assert printed.count("(compute floor ") == 2  # the TTFT's and the prefill's
    assert len(report["ttft_runs_ms"]) == 5 and sorted(report["ttft_runs_ms"])[2] == report["ttft_ms"]
    assert report["switches"]["ft.distributed:SYMM_ALL_REDUCE"] is False  # what the run had, recorded
    assert "kernel switches on: " in printed
    assert report["switches"]["engine:decode_ahead"] is True and "engine.decode_ahead" in printed  # default


def test_bench_offline_census(tmp_path, capsys):
    """--census counts what a decode step and a prefill run (leaf CPU operators here)."""
    write_checkpoint(tmp_path, "qwen3_next")
    out_json = tmp_path / "bench.json"
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1", "--input-len", "12", "--output-len", "3"]
    assert main([*argv, "--prefill-lens", "", "--census", "--output-json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "census decode (batch 1):" in printed and "census prefill (12 tokens):" in printed
    decode, prefill = json.loads(out_json.read_text())["census"]
    assert decode["steps"] == 4 and decode["kernels_per_step"] > 10
    assert prefill["kernels_per_step"] > decode["kernels_per_step"] / 2
    times = [row[2] for row in decode["top"]]
    assert times == sorted(times, reverse=True) and all(row[1] > 0 for row in decode["top"])
    assert "aten::linear" not in [row[0] for row in decode["top"]]  # leaves only: no double counting
    assert decode["allreduce_ms_per_step"] == 0  # one rank: nothing to reduce
    assert decode["allreduce_in_step"] == [] and "all-reduce" not in printed
    # each costliest kernel's line reads calls x time a call = its time a step
    name, count, us = next(row for row in decode["top"] if row[1] > 1)
    line = next(x for x in printed.splitlines() if x.endswith(f"  {name[:100]}"))
    got = re.fullmatch(r"\s*([\d.]+) x\s+([\d.,]+) us = \s*([\d.,]+) us a step  .*", line).groups()
    calls, each, step = (float(v.replace(",", "")) for v in got)
    assert calls == pytest.approx(count, abs=0.05) and step == pytest.approx(us, abs=0.05)
    assert each == pytest.approx(us / count, abs=0.05)


def test_bench_offline_census_at_tp2_counts_the_all_reduces(tmp_path, capsys):
    """At TP=2 the first rank profiles itself in its own process: the census still counts a step,
    and the all-reduces (gloo's operators here, NCCL's kernels on GPUs) are reported apart. The
    decode step's all-reduces are also timed alone, ranks in step, for the counted batch and for
    the bench's largest, as a share of the decode step the bench measured."""
    write_checkpoint(tmp_path, "qwen3_next", num_key_value_heads=4)
    config = json.loads((tmp_path / "config.json").read_text())
    out_json = tmp_path / "bench.json"
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1,3", "--input-len", "12", "--output-len", "3", "--tp-size"]
    assert main([*argv, "2", "--prefill-lens", "", "--census", "--output-json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "all-reduce kernels" in printed and "includes waiting for the slower rank" in printed
    decode, prefill = json.loads(out_json.read_text())["census"]
    assert decode["kernels_per_step"] > 10 and decode["allreduce_ms_per_step"] > 0
    assert any("allreduce" in row[0] for row in decode["top"])
    assert prefill["allreduce_ms_per_step"] > 0 and prefill["allreduce_in_step"] == []
    # a decode step reduces the vocab-parallel embedding, then in every layer the token mixer's
    # row-parallel output projection (attention or GDN) and the MoE block's routed + shared sum
    per_step = 1 + 2 * config["num_hidden_layers"]
    hidden = config["hidden_size"]
    one, wide = decode["allreduce_in_step"]
    assert (one["batch"], one["count"], one["scaled"], one["timed"]) == (1, per_step, False, "eager")
    assert one["messages"] == [[[1, hidden], "fp32", per_step]]
    assert one["bytes_per_step"] == per_step * hidden * 4
    assert one["ms_per_step"] > 0 and one["step_ms"] > 0 and one["step_share"] > 0
    assert (wide["batch"], wide["count"], wide["scaled"]) == (3, per_step, True)
    assert wide["messages"] == [[[3, hidden], "fp32", per_step]] and wide["ms_per_step"] > 0
    assert f"all-reduce in step: {per_step} x [1, {hidden}] fp32" in printed
    assert f"all-reduce in a batch-3 step: {per_step} x [3, {hidden}] fp32" in printed


def test_bench_offline_census_of_a_batch(tmp_path, capsys):
    """--census-batch 3: the decode census counts a step of three sequences; 0 is refused."""
    write_checkpoint(tmp_path, "qwen3_next")
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1", "--input-len", "12", "--output-len", "3"]
    argv += ["--prefill-lens", "", "--census"]
    out_json = tmp_path / "bench.json"
    assert main([*argv, "--census-batch", "3", "--output-json", str(out_json)]) == 0
    assert "census decode (batch 3):" in capsys.readouterr().out
    decode = json.loads(out_json.read_text())["census"][0]
    assert decode["phase"] == "decode (batch 3)" and decode["device_ms_per_step"] > 0
    with pytest.raises(SystemExit):
        main([*argv, "--census-batch", "0"])


def test_decode_bytes_count_distinct_experts(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next")
    mc = load_model_config(str(tmp_path))
    model = build_model(mc, TPInfo(0, 1), "meta", torch.bfloat16)
    one, many = (decode_step_bytes(model, mc, b, 100) for b in (1, 1000))
    per_expert = 3 * mc.moe_intermediate_size * mc.hidden_size * 2 * mc.num_layers
    assert one.experts == mc.num_experts_per_tok * per_expert  # k distinct experts for one token
    assert abs(many.experts - mc.num_experts * per_expert) <= mc.num_layers  # all of them for many
    assert one.dense == many.dense and many.kv == 1000 * one.kv


def test_prefill_flops_are_transformers_matmuls(tmp_path):
    """The prefill floor's FLOPs against transformers' forward of the same checkpoint under torch's
    FLOP counter (its last token's logits only, eager attention): the dense projections, routers
    and one row of lm_head are its ``mm`` FLOPs; attention is its ``bmm`` FLOPs (QK^T and PV over
    every key) times the causal share (L + 1) / 2L. Its experts run as grouped matmuls the counter
    does not count: those are 2 · 3 · H · I FLOPs a routed token and layer, from the config."""
    from torch.utils.flop_counter import FlopCounterMode

    from ft.bench.roofline import prefill_flops

    hf = write_checkpoint(tmp_path, "qwen3_moe", seed=1)
    hf.set_attn_implementation("eager")
    mc = load_model_config(str(tmp_path))
    model = build_model(mc, TPInfo(0, 1), "meta", torch.bfloat16)
    length = 24
    with FlopCounterMode(display=False) as counter:
        hf(torch.randint(0, mc.vocab_size, (1, length)), logits_to_keep=1)
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    got = prefill_flops(model, mc, length)
    assert got.dense + got.lm_head == ops["aten.mm"]
    assert got.attention == ops["aten.bmm"] * (length + 1) / (2 * length)
    k, inter = mc.num_experts_per_tok, mc.moe_intermediate_size
    assert got.experts == 2 * 3 * mc.hidden_size * inter * k * length * mc.num_layers
    assert got.recurrent == 0
    assert prefill_flops(model, mc, 2 * length).dense == 2 * got.dense  # linear in the prompt


def test_prefill_flops_of_a_hybrid_model(tmp_path):
    """Qwen3-Next: attention only in its full-attention layers (causal: L(L + 1)/2 keys a head),
    the GDN recurrence 6 · dk · dv a value head and token in the others; a sparse layer's
    ``max_keys`` caps what a query attends (each query past the cap sees ``max_keys`` keys)."""
    from ft.bench.roofline import prefill_flops

    write_checkpoint(tmp_path, "qwen3_next")
    mc = load_model_config(str(tmp_path))
    model = build_model(mc, TPInfo(0, 1), "meta", torch.bfloat16)
    length, gdn = 40, mc.layer_types.count("linear_attention")
    got = prefill_flops(model, mc, length)
    dk, dv, hv = mc.linear_key_head_dim, mc.linear_value_head_dim, mc.linear_num_value_heads
    assert got.recurrent == 6 * hv * dk * dv * length * gdn
    causal = 4 * mc.num_heads * mc.head_dim * length * (length + 1) / 2
    assert got.attention == causal * (mc.num_layers - gdn)
    attn = [m for m in model.modules() if hasattr(m, "cache_shape")]
    for m in attn:
        m.max_keys = 16
    capped = 4 * mc.num_heads * mc.head_dim * (16 * 17 / 2 + (length - 16) * 16)
    assert prefill_flops(model, mc, length).attention == capped * len(attn)


def test_bench_offline_compare_hf_adds_a_transformers_row(tmp_path, capsys):
    """--compare-hf times transformers' generate on the same config (random weights) after the
    engine's rows, in the same command."""
    write_checkpoint(tmp_path, "qwen3_moe")
    out_json = tmp_path / "bench.json"
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1", "--input-len", "8", "--output-len", "3"]
    assert main([*argv, "--prefill-lens", "", "--compare-hf", "--output-json", str(out_json)]) == 0
    assert "transformers single_stream_tok_s" in capsys.readouterr().out
    hf = json.loads(out_json.read_text())["hf"]
    assert hf["single_stream_tok_s"] > 0 and hf["ttft_ms"] > 0


def test_an_offloaded_prefill_reports_its_share_of_the_link():
    """The prefill line gives the bytes the prefill moved over PCIe, their rate over its wall time
    and that rate against the measured host-to-device copy rate (issue 8's prefill figure)."""
    from ft.bench.report import Report, format_report

    moe = dict(backend="offload", slots_per_layer=393, experts_per_layer=512, residency=0.77, policy="lru",
               prefetch=True, routing_skew=0.0, h2d_gb_s=55.0)  # fmt: skip
    r = Report("m", "H200", 4200.0, prefill={8000: 8000.0}, prefill_streamed={8000: 36e9}, moe=moe)
    want = (
        "prefill 8000 tokens: 8,000 tok/s, first token in 1.00 s; "
        "streamed 36.00 GB at 36.0 GB/s (65% of the link)"
    )
    assert want in format_report(r)


def test_prefill_runs_are_each_printed_beside_the_middle_one():
    """With --prefill-runs the line reports the middle run and lists every run's rate and share."""
    from ft.bench.report import Report, format_report

    moe = dict(backend="offload", slots_per_layer=393, experts_per_layer=512, residency=0.77, policy="lru",
               prefetch=True, routing_skew=0.0, h2d_gb_s=50.0)  # fmt: skip
    runs = [(8000.0, 40e9), (6400.0, 40e9), (10000.0, 40e9)]  # 40, 32 and 50 GB/s
    r = Report("m", "H200", 4200.0, prefill={8000: 8000.0}, prefill_streamed={8000: 40e9}, moe=moe,
               prefill_runs={8000: runs})  # fmt: skip
    want = (
        "prefill 8000 tokens: 8,000 tok/s, first token in 1.00 s; "
        "streamed 40.00 GB at 40.0 GB/s (80% of the link); "
        "runs 8,000 / 6,400 / 10,000 tok/s (80.0% / 64.0% / 100.0% of the link)"
    )
    assert want in format_report(r)


def test_bench_offline_prefill_runs(tmp_path, capsys):
    """--prefill-runs 3: three prefills of fresh prompts after the warm-up, the middle rate reported."""
    write_checkpoint(tmp_path, "qwen3_next")
    out_json = tmp_path / "bench.json"
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1", "--input-len", "8", "--output-len", "2"]
    assert main([*argv, "--prefill-lens", "16", "--prefill-runs", "3", "--output-json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    rates = [rate for rate, _ in report["prefill_runs"]["16"]]
    assert len(rates) == 3 and report["prefill"]["16"] == sorted(rates)[1]
    assert "; runs " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--prefill-runs must be at least 1"):
        main([*argv, "--prefill-lens", "16", "--prefill-runs", "0"])


def test_bench_offline_prefill_as_long_as_the_pool(tmp_path, capsys):
    """A prefill row as long as the KV pool runs (its one generated token is never cached: a
    262,144-token prompt with --num-tokens 262144); one token longer stops before any row is run."""
    write_checkpoint(tmp_path, "qwen3_next")
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "", "--input-len", "8", "--output-len", "2"]
    argv += ["--num-tokens", "48", "--block-size", "16"]
    assert main([*argv, "--prefill-lens", "48"]) == 0
    assert "prefill 48 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="the KV pool holds 48 tokens, the longest request 49"):
        main([*argv, "--prefill-lens", "49"])
    assert "single-stream" not in capsys.readouterr().out
    # the census's prompt decodes more than the rows' (CENSUS_TOKENS and one per sequence)
    argv[argv.index("--input-len") + 1] = "43"  # rows: 43 + 3 - 1 tokens; the census: 43 + 7 - 1
    with pytest.raises(SystemExit, match="the KV pool holds 48 tokens, the longest request 49"):
        main([*argv, "--prefill-lens", "", "--census"])


def test_the_device_peak_is_reported_against_the_plan():
    """On CUDA the report ends its MoE lines with the device's peak against what the plan allowed,
    the part of that kept for activations and the prefill chunk: the figures that say whether the
    reserve could have gone to the expert cache."""
    from ft.bench.report import Report, format_report

    memory = dict(peak_gib=121.5, peak_allocated_gib=118.25, plan_gib=130.69, reserve_gib=6.95,
                  prefill_chunk=16384)  # fmt: skip
    text = format_report(Report("m", "H200", 4200.0, memory=memory))
    want = ("device memory: peak 121.50 GiB (live tensors 118.25) of the 130.69 GiB planned "
            "(cap x --memory-ratio), 6.95 GiB of it kept for activations; prefill chunk 16384")  # fmt: skip
    assert want in text
    assert "device memory" not in format_report(Report("m", "cpu", 50.0))
