"""The Gated DeltaNet's Triton conv kernels run by Triton's interpreter on CPU tensors.

Skipped where triton is not installed (CPU CI). The interpreter is chosen when a kernel is
decorated, so each check runs in a fresh process with ``TRITON_INTERPRET=1``, under ``python -O``
because the wrappers assert CUDA tensors (so the checks raise explicitly instead of asserting).
Exact rounding is checked in fp16 and fp32 (the interpreter truncates to bf16).
``tests/gpu/test_kernels.py`` checks the compiled kernels on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.slow,
]
ROOT = Path(__file__).resolve().parents[1]


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def check_conv_decode_one_launch() -> None:
    """A decode batch's conv in one launch (``DECODE_ONE_LAUNCH``) equals the two launches bit
    for bit, output and history, and the torch reference: sequences with and without context,
    slots out of order, a channel count that is not a multiple of the tile."""
    from ft.gdn import triton_conv
    from ft.gdn.torch_ref import TorchGDN
    from tests.gpu.test_kernels import make_batch

    c, kc, slots = 300, 4, [3, 0, 5, 2]
    batch, _ = make_batch([(5, 1), (0, 1), (17, 1), (2, 1)], 16, device="cpu", state_slots=slots)
    for dtype in (torch.float16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, c, generator=gen).to(dtype)
        weight = torch.randn(c, kc, generator=gen).to(dtype)
        state = torch.randn(8, c, kc - 1, generator=gen).to(dtype)
        results = []
        for one in (False, True):
            triton_conv.DECODE_ONE_LAUNCH = one
            st = state.clone()
            results.append((triton_conv.causal_conv1d_silu(x, weight, st, batch, 1), st))
        (two_out, two_state), (one_out, one_state) = results
        require(torch.equal(one_out, two_out), f"{dtype}: outputs differ")
        require(torch.equal(one_state, two_state), f"{dtype}: histories differ")
        untouched = [s for s in range(8) if s not in slots]
        require(torch.equal(one_state[untouched], state[untouched]), f"{dtype}: other slots changed")
        ref_state = state.clone()
        ref = TorchGDN().conv(x, weight, ref_state, batch)
        require(torch.equal(one_state, ref_state), f"{dtype}: history differs from the reference")
        err = (one_out.float() - ref.float()).abs().max().item()
        bound = 1e-2 if dtype == torch.float16 else 1e-5
        require(err < bound, f"{dtype}: output off the reference by {err}")


CHECKS = ["check_conv_decode_one_launch"]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    code = f"from tests.test_gdn_interp import {check}; {check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-O", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
