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
