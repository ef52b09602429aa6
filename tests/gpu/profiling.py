"""What the profiling scripts beside this file share (not a test): a log that prints and appends
to a file, a model config cut to its first layers, engine steps timed, and the host time of
wrapped parts."""

from __future__ import annotations

import json
import statistics
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


def log_medians(log: Callable[[str], None], rows: dict[str, list[float]], what: str, unit: str) -> None:
    """One line a setting of an A/B script's rounds: the median of its figures, their count and range."""
    for name, values in rows.items():
        log(f"== {what} {name}: median {statistics.median(values):.1f} {unit} of {len(values)} "
            f"(min {min(values):.1f}, max {max(values):.1f})")  # fmt: skip


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


def critical_path(trace: str, steps: int, top: int = 12) -> list[str]:
    """Lines on where the busiest stream's time went in a chrome trace of ``torch.profiler``
    (``export_chrome_trace``), per step: each kernel's own share of the stream's wall time
    (from the later of its start and the previous kernel's end to its end, so that a kernel
    launched early by programmatic dependent launch, waiting on its predecessor, is charged only
    for what it added), the stream's idle time between kernels, and the other streams' busy
    time (copies, a side stream's kernels)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    busy_by_stream: dict = {}
    for e in gpu:
        s = e.get("args", {}).get("stream", -1)
        busy_by_stream[s] = busy_by_stream.get(s, 0.0) + e["dur"]
    if not busy_by_stream:
        return ["no GPU events in the trace"]
    main = max(busy_by_stream, key=busy_by_stream.get)
    own: dict = {}
    idle, end, gaps, last = 0.0, None, [], ""
    on_main = sorted(
        (e for e in gpu if e.get("args", {}).get("stream", -1) == main), key=lambda e: e["ts"] + e["dur"]
    )
    for e in on_main:
        a, b, name = e["ts"], e["ts"] + e["dur"], e["name"][:60]
        if end is not None and a > end:
            idle += a - end
            gaps.append((a - end, last, name))
        share = b - a if end is None else max(0.0, b - max(a, end))
        own[name] = own.get(name, 0.0) + share
        end, last = (b if end is None else max(end, b)), name
    per = steps * 1e3  # us -> ms a step
    total = sum(own.values()) / per
    lines = [f"stream {main}: kernels' own time {total:.2f} ms a step, idle between them {idle / per:.2f} ms"]
    lines += [
        f"  {us / per:7.3f} ms  {name}" for name, us in sorted(own.items(), key=lambda kv: -kv[1])[:top]
    ]
    lines += [f"  idle {us:7.1f} us after {a} before {b}" for us, a, b in sorted(gaps, reverse=True)[:5]]
    lines += [f"stream {s}: busy {us / per:.2f} ms a step" for s, us in busy_by_stream.items() if s != main]
    return lines
