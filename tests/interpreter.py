"""Checks of Triton kernels run by Triton's interpreter on CPU tensors, each in a fresh process.

The interpreter is chosen when a kernel is decorated, so a check cannot share a process with
code that imported the kernels compiled: ``run_check`` runs ``module.check()`` in a new Python
with ``TRITON_INTERPRET=1`` (and ``-O`` for checks that call wrappers asserting CUDA tensors).
Files of such checks mark themselves ``pytestmark = INTERPRETER`` (skipped without triton, and
slow: the interpreter runs one program at a time).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.slow,
]


def run_check(module: str, check: str, optimize: bool = False, timeout: int = 600) -> None:
    code = f"from tests.interpreter import widen_moe_tiles; widen_moe_tiles(); from {module} import {check}"
    code += f"; {check}()"
    run_fresh(code, {"TRITON_INTERPRET": "1"}, optimize, timeout)


# the MoE GEMV's tiles, (BLOCK_N, BLOCK_K, warps, stages) each, that ``widen_moe_tiles`` widens
MOE_TILES = (
    "BF16",
    "NVFP4",
    "BF16_DOWN",
    "NVFP4_DOWN",
    "PAIR_DOWN",
    "NVFP4_PLANES",
    "NVFP4_DOWN_PLANES",
    "NVFP4_INT",
)


def widen_moe_tiles(by: int = 16) -> None:
    """The MoE GEMV's tiles under the interpreter: ``by`` times the rows a program (BLOCK_N) of the
    shipped ones, the same input steps (BLOCK_K: the checks' K steps and tails are sized by them).
    The interpreter runs one program at a time at a mostly fixed cost, so fewer, wider programs
    take far less time (the words' check 212 -> 27 s at 8 times, 21 s at 16, on a 2-core CPU with
    triton 3.8); the checks' shapes still leave row tails and several row blocks. The GPU tests
    run the shipped tiles."""
    from ft.moe.kernels import triton_moe_gemv

    for name in MOE_TILES:
        tiles = getattr(triton_moe_gemv, name)
        if tiles is not None:
            setattr(triton_moe_gemv, name, (tiles[0] * by, *tiles[1:]))


def run_fresh(code: str, env: dict[str, str], optimize: bool = False, timeout: int = 600) -> None:
    """``code`` in a new Python at the repository root with ``env`` added to this environment
    (settings Triton reads when it compiles or decorates a kernel); fails with its stderr."""
    args = [sys.executable, *(["-O"] if optimize else []), "-c", code]
    run = subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-4000:]
