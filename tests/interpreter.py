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
    run_fresh(f"from {module} import {check}; {check}()", {"TRITON_INTERPRET": "1"}, optimize, timeout)


def run_fresh(code: str, env: dict[str, str], optimize: bool = False, timeout: int = 600) -> None:
    """``code`` in a new Python at the repository root with ``env`` added to this environment
    (settings Triton reads when it compiles or decorates a kernel); fails with its stderr."""
    args = [sys.executable, *(["-O"] if optimize else []), "-c", code]
    run = subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-4000:]
