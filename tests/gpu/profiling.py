"""What the profiling scripts beside this file share (not a test): a log that prints and appends
to a file, a model config cut to its first layers, engine steps timed, and the host time of
wrapped parts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def logger(out: str | None) -> Callable[[str], None]:
    """Print a line, and append it to ``out`` when given (a run cut short keeps what it said)."""

    def log(line: str) -> None:
        print(line, flush=True)
        if out:
            with Path(out).open("a") as f:
                print(line, file=f)

    return log


def cut_config(src: str, layers: int) -> tuple[str, dict]:
    """The config.json at ``src`` with its first ``layers`` layers, written to /tmp: (path, config)."""
    cfg = json.loads(Path(src).read_text()) | {"num_hidden_layers": layers}
    path = f"/tmp/ft_cut_{layers}.json"
    Path(path).write_text(json.dumps(cfg))
    return path, cfg


def time_steps(engine, steps: int, sync: Callable[[], None], counters=(), warmup: int = 0) -> float:
    """Seconds a step of ``steps`` engine steps after ``warmup`` untimed ones (a request's prefill
    and first decode steps), the device synchronised before and after; the ``counters`` (the
    wrapped parts' seconds and calls) cleared first, so they count the timed steps."""
    for _ in range(warmup):
        engine.step()
    for c in counters:
        c.clear()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - t0) / steps


def log_parts(log: Callable[[str], None], seconds, calls, per: int) -> None:
    """Each wrapped part's host time (costliest first) over ``per`` steps: a step's share, its
    calls a step and the time a call."""
    for key in sorted(seconds, key=seconds.get, reverse=True):
        per_call = seconds[key] / max(calls[key], 1) * 1e6
        log(f"  {key:34s} {seconds[key] / per * 1e3:8.3f} ms a step  "
            f"{calls[key] / per:6.1f} calls  {per_call:7.1f} us a call")  # fmt: skip
