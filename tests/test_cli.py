"""``ft generate`` prints the same continuation as the Python API."""

from __future__ import annotations

import subprocess
import sys

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
