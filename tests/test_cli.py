"""``ft generate`` prints the same continuation as the Python API."""

from __future__ import annotations

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
