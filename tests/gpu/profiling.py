"""What the profiling scripts beside this file share (not a test): a log that prints and appends
to a file, a model config cut to its first layers, engine steps timed, and the host time of
wrapped parts."""

from __future__ import annotations

import collections
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
    others = sorted(((us, s) for s, us in busy_by_stream.items() if s != main), reverse=True)
    lines += [f"stream {s}: busy {us / per:.2f} ms a step" for us, s in others[:5]]
    if len(others) > 5:  # a replayed graph's kernels spread over many stream ids
        rest = sum(us for us, _ in others[5:])
        lines.append(f"{len(others) - 5} more streams: busy {rest / per:.2f} ms a step")
    return lines


LINK_KERNELS = ("_copy_rows_kernel", "_stage_kernel", "Memcpy HtoD")  # what crosses PCIe at decode


def link_timeline(trace: str, steps: int, link=LINK_KERNELS, top: int = 10) -> list[str]:
    """Lines on how an offload step's link time sits beside its compute, from a chrome trace of
    ``torch.profiler`` by time alone (a replayed graph's kernels spread over many stream ids):
    per step, the time the link is busy (any event whose name starts with one of ``link``) with
    compute and alone, compute alone, and neither, between the first event and the last; then the
    compute kernels that run while the link idles, the time a batch-1 offload step could still
    hide copies behind (a stretch shared by several kernels split between them)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        return ["no GPU events in the trace"]
    edges = []
    for e in gpu:
        name = e["name"][:60]
        is_link = name.startswith(link)
        edges += [(e["ts"], 1, is_link, name), (e["ts"] + e["dur"], -1, is_link, name)]
    edges.sort(key=lambda x: (x[0], x[1]))
    links, active = 0, collections.Counter()
    spent = collections.Counter()
    unhidden = collections.Counter()  # compute kernel -> its time with the link idle
    for (t, step, is_link, name), nxt in zip(edges, edges[1:] + [None]):
        if is_link:
            links += step
        else:
            active[name] += step
            if active[name] == 0:
                del active[name]
        span = 0.0 if nxt is None else nxt[0] - t
        if span <= 0:
            continue
        kind = ("both" if active else "link") if links else ("compute" if active else "neither")
        spent[kind] += span
        if kind == "compute":
            for n in active:
                unhidden[n] += span / len(active)
    per = steps * 1e3  # us -> ms a step
    lines = [
        f"link busy {(spent['both'] + spent['link']) / per:.2f} ms a step ({spent['both'] / per:.2f} beside "
        f"compute, {spent['link'] / per:.2f} alone), compute alone {spent['compute'] / per:.2f} ms, "
        f"neither {spent['neither'] / per:.2f} ms"
    ]
    lines += [
        f"  {us / per:7.3f} ms  {name} (link idle)"
        for name, us in sorted(unhidden.items(), key=lambda kv: -kv[1])[:top]
    ]
    return lines
