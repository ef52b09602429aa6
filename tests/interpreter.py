"""Checks of Triton kernels run by Triton's interpreter on CPU tensors, each in a process of its own.

The interpreter is chosen when a kernel is decorated, so a check cannot share a process with
code that imported the kernels compiled, and checks set module-level switches, so one check's
settings must not reach the next. ``run_check`` runs ``module.check()`` in a child forked from a
Python that has ``TRITON_INTERPRET=1`` (and ``-O`` for checks that call wrappers asserting CUDA
tensors) and has imported the module once: a fresh process per check paid ~5 s of imports on a
2-core CPU, a fork pays none. Files of such checks mark themselves ``pytestmark = INTERPRETER``
(skipped without triton, and slow: the interpreter runs one program at a time).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.slow,
]

# the checks' server: reads "check<TAB>log path" lines, runs each check in a forked child whose
# output goes to the log, and answers the child's exit code on the stdout it started with (the
# imports' and the checks' own prints go to stderr and the logs, never into the answers)
SERVER = r"""
import importlib, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
from tests.interpreter import widen_moe_tiles
widen_moe_tiles()
module = importlib.import_module(sys.argv[1])
for line in sys.stdin:
    check, log = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            getattr(module, check)()
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), file=answers, flush=True)
"""


class CheckServer:
    """One server Python for the checks of ``module`` (see ``SERVER``)."""

    def __init__(self, module: str, optimize: bool) -> None:
        args = [sys.executable, *(["-O"] if optimize else []), "-c", SERVER, module]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.key = (module, optimize)
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True,  # its own process group: a timeout kills the check's child too
        )  # fmt: skip

    def run(self, check: str, timeout: float) -> None:
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            try:
                self.proc.stdin.write(f"{check}\t{log.name}\n")
                self.proc.stdin.flush()
                ready = select.select([self.proc.stdout], [], [], timeout)[0]
                answer = self.proc.stdout.readline() if ready else None
            except BaseException:  # pytest-timeout's, say: the answer still owed would be misread
                self.close()
                raise
            if answer is None:
                self.close()
                raise AssertionError(f"{check} ran past {timeout} s:\n{log.read()[-4000:]}")
            if not answer:  # the server died (in an import: its stderr is the test's output)
                self.close()
                raise AssertionError(f"the checks' server for {self.key[0]} exited")
            code = int(answer)  # a signal's is minus its number
            assert code == 0, f"{check} exited with {code}:\n{log.read()[-4000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_server: CheckServer | None = None  # one at a time: a module's tests run one after another


def run_check(module: str, check: str, optimize: bool = False, timeout: int = 600) -> None:
    """``module.check()`` under the interpreter, with the MoE GEMV's tiles widened; fails with
    the end of what it printed."""
    global _server
    if _server is None or _server.key != (module, optimize) or _server.proc.poll() is not None:
        if _server is not None:
            _server.close()
        _server = CheckServer(module, optimize)
    _server.run(check, timeout)


@atexit.register
def _close_server() -> None:
    if _server is not None:
        _server.close()


# the MoE GEMV's tiles, (BLOCK_N, BLOCK_K, warps, stages) each, that ``widen_moe_tiles`` widens
MOE_TILES = (
    "BF16",
    "NVFP4",
    "PAIR_DOWN",
    "NVFP4_PLANES",
    "NVFP4_DOWN_PLANES",
    "NVFP4_INT",
    "BF16_HOST",
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


def exact_bf16_dots() -> None:
    """Make the interpreter's ``tl.dot`` multiply bf16 operands as numbers: it keeps bf16 as their
    uint16 bit patterns and multiplies those (triton issue 11584, still in 3.8), so without this a
    kernel whose MMAs take bf16 (the W4A16 kernel) cannot be checked on CPU. For a forked check."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def widened(handle):
        if handle.data.dtype == np.uint16 and handle.dtype.is_bf16():
            wide = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(wide, interpreter.tl.float32)
        return handle

    builder.create_dot = lambda self, a, b, d, *rest: dot(self, widened(a), widened(b), d, *rest)


def run_fresh(code: str, env: dict[str, str], optimize: bool = False, timeout: int = 600) -> None:
    """``code`` in a new Python at the repository root with ``env`` added to this environment
    (settings Triton reads when it compiles or decorates a kernel); fails with its stderr."""
    args = [sys.executable, *(["-O"] if optimize else []), "-c", code]
    run = subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-4000:]
