"""``ft generate`` prints the same continuation as the Python API."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint


def test_generate_token_ids(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next", seed=9)
    cmd = [
        sys.executable,
        "-m",
        "ft",
        "generate",
        "--model",
        str(tmp_path),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--prompt",
        "4,8,15,16,23,42",
        "--token-ids",
        "--max-tokens",
        "6",
        "--ignore-eos",
    ]
    out = (
        subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        want = llm.generate(
            [[4, 8, 15, 16, 23, 42]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
    assert out == " ".join(map(str, want[0].token_ids))


def test_prefix_cache_switch_reaches_every_command():
    from ft.cli import build_parser, engine_options

    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["bench", "offline"], ["serve"]):
        assert engine_options(parser.parse_args(argv))["enable_prefix_cache"] is True
        off = parser.parse_args([*argv, "--disable-prefix-cache"])
        assert engine_options(off)["enable_prefix_cache"] is False


def test_prefix_snapshot_slots_reach_the_state_pool(tmp_path):
    """``--prefix-snapshot-slots`` from every command into the engine: the GDN state pool holds
    that many snapshot rows (default: one per running request); 0 is refused."""
    from ft.cli import build_parser, engine_options
    from ft.config import EngineConfig

    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["bench", "offline"], ["serve"]):
        assert engine_options(parser.parse_args(argv))["prefix_snapshot_slots"] is None
        options = engine_options(parser.parse_args([*argv, "--prefix-snapshot-slots", "3"]))
        assert options["prefix_snapshot_slots"] == 3
    with pytest.raises(ValueError, match="prefix_snapshot_slots"):
        EngineConfig(config_file="x.json", load_format="dummy", prefix_snapshot_slots=0)
    write_checkpoint(tmp_path, "qwen3_next", seed=1)
    for slots, want in ((None, 4), (2, 2)):
        with LLM(model=str(tmp_path), device="cpu", progress=False, max_running_requests=4,
                 prefix_snapshot_slots=slots) as llm:  # fmt: skip
            assert llm.engine.plan.num_snapshots == want


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    import json

    from tests.checkpoints import QWEN3_NEXT_BASE

    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(QWEN3_NEXT_BASE | dict(model_type="qwen3_next")))
    return str(path)


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--memory-ratio", "2"], r"memory_ratio=2\.0 is out of range"),
        (["--max-gpu-memory", "lots"], r"max_gpu_memory='lots': expected a number"),
        (["--tp-size", "3"], r"tp_size=3 does not fit the model: linear_num_key_heads"),
        (["--max-model-len", "4096"], r"max_model_len=4096 is beyond the model's max_position_embeddings"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "1", "--token-ids"],
        ["bench", "offline", "--input-len", "8", "--output-len", "4", "--prefill-lens", ""],
    ],
)
def test_bad_engine_options_exit_with_their_name(tiny_config, command, argv, why):
    """Every command that starts an engine says which option is wrong, as a message (no traceback),
    before any rank starts or weight is read."""
    from ft.cli import main

    argv = [*command, "--config", tiny_config, "--load-format", "dummy", "--device", "cpu", *argv]
    with pytest.raises(SystemExit, match=rf"^ft {command[0]}: .*{why}"):
        main(argv)


def test_bench_says_it_chose_a_max_model_len_beyond_the_models_positions(tiny_config):
    from ft.cli import main

    argv = ["bench", "offline", "--config", tiny_config, "--load-format", "dummy", "--device", "cpu"]
    why = r"max_model_len=32769 is beyond .* 512; ft bench sets max_model_len to its longest request"
    with pytest.raises(SystemExit, match=why):
        main(argv)


def test_serve_refuses_a_tp_size_before_starting_the_engine(tiny_config, capsys):
    from ft.cli import main

    argv = ["serve", "--config", tiny_config, "--load-format", "dummy", "--device", "cpu", "--tp-size", "3"]
    assert main(argv) == 2
    assert "ft serve: EngineConfig.tp_size=3 does not fit the model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "tp,why",
    [
        ("0", r"--tp-size 0: must be at least 1"),
        ("-2", r"--tp-size -2: must be at least 1"),
        ("1,x", r"--tp-size '1,x': expected sizes like 1,2,4,8"),
        ("", r"--tp-size '': expected sizes like 1,2,4,8"),
        ("1,3", r"--tp-size 3: linear_num_key_heads over tp ranks: 2 is not divisible by 3"),
    ],
)
def test_info_refuses_a_bad_tp_size_by_name(tiny_config, tp, why):
    from ft.cli import main

    with pytest.raises(SystemExit, match=rf"^ft info: {why}"):
        main(["info", "--config", tiny_config, "--tp-size", tp])


def test_info_names_a_config_it_cannot_read(tmp_path):
    from ft.cli import main

    with pytest.raises(SystemExit, match=r"^ft info: no config\.json at"):
        main(["info", "--model", str(tmp_path)])
    (tmp_path / "config.json").write_text('{"model_type": "llama9"}')
    with pytest.raises(SystemExit, match=r"^ft info: .*config field model_type: 'llama9'"):
        main(["info", "--model", str(tmp_path)])


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--load-format", "dummy", "--dummy-routing-skews", "0,-1"], r"skew=-1\.0 is out of range"),
        (["--dummy-routing-skews", "0,1"], r"skew=1\.0 shapes the routers of dummy weights only"),
        (["--load-format", "dummy", "--expert-cache-policies", "lru,mru"], r"expert_cache_policy: 'mru'"),
        (["--load-format", "dummy", "--batch-sizes", "1,x"], r"--batch-sizes '1,x': expected"),
        (["--load-format", "dummy", "--batch-sizes", "0"], r"--batch-sizes '0': expected"),
        (["--load-format", "dummy", "--prefill-lens", "16,0"], r"--prefill-lens '16,0': expected"),
        (["--load-format", "dummy", "--dummy-routing-skews", "0,x"], r"-skews '0,x': expected numbers"),
        (["--input-len", "0"], r"--input-len must be at least 1, got 0"),
        (["--output-len", "-3"], r"--output-len must be at least 1, got -3"),
        (["--census-batch", "0"], r"--census-batch must be at least 1, got 0"),
        (["--prefill-runs", "0"], r"--prefill-runs must be at least 1, got 0"),
    ],
)
def test_bench_variants_are_checked_before_the_model_loads(tiny_config, argv, why):
    """Each variant ``ft bench offline`` switches to after loading is checked before it loads."""
    import os

    from ft.cli import main

    argv = ["bench", "offline", "--model", os.path.dirname(tiny_config), "--device", "cpu", "--input-len",
            "8", "--output-len", "4", "--prefill-lens", "", *argv]  # fmt: skip
    with pytest.raises(SystemExit, match=rf"^ft bench: .*{why}"):
        main(argv)


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--port", "70000"], r"--port 70000: expected 0 to 65535"),
        (["--port", "-1"], r"--port -1: expected 0 to 65535"),
        (["--max-request-bytes", "0"], r"--max-request-bytes must be at least 1"),
        (["--max-request-bytes", "-5"], r"--max-request-bytes must be at least 1"),
    ],
)
def test_serve_refuses_bad_server_numbers_before_binding(tiny_config, capsys, monkeypatch, argv, why):
    """A port past 65535 was taken modulo 65536 (70000 listened on 4464); a body limit of 0 meant
    the default and a negative one refused every request."""
    from ft.cli import main
    from ft.server import cli

    monkeypatch.setattr(cli, "_bind", lambda host, port: pytest.fail(f"bound {host}:{port}"))
    assert main(["serve", "--config", tiny_config, "--load-format", "dummy", "--device", "cpu", *argv]) == 2
    assert re.search(rf"^ft serve: {why}", capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--prompt", "1,x", "--token-ids"], r"--prompt '1,x': expected comma-separated token ids"),
        (["--prompt", "", "--token-ids"], r"--prompt '': expected comma-separated token ids"),
        (["--prompt", "Hello"], r"--prompt 'Hello' is text, and .* has no tokenizer files: .*--token-ids"),
    ],
)
def test_generate_refuses_a_prompt_it_cannot_read_before_loading(tiny_config, monkeypatch, argv, why):
    """A bad --token-ids prompt, or text for a checkpoint without a tokenizer, was found once the
    model had loaded, as a traceback."""
    import os

    import ft
    from ft.cli import main

    monkeypatch.setattr(ft, "LLM", lambda **options: pytest.fail("the model was loaded"))
    argv = ["generate", "--model", os.path.dirname(tiny_config), "--device", "cpu", *argv]
    with pytest.raises(SystemExit, match=rf"^ft generate: {why}"):
        main(argv)
