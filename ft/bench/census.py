"""Kernel census (``ft bench offline --census``): what one decode step and one prefill launch,
counted and timed by ``torch.profiler``. Decode is bound by how many kernels a step launches, not
by bytes, so this table is what to read before fusing anything, and after, to see it worked.

For each phase: kernels per step, their summed device time, the step's wall time, and the kernels
that take the most time with their counts. CUDA graphs are bypassed while counting (a replay is
one launch to the profiler), so the decode rows are the eager step's kernels, which are the
graph's. With tensor parallelism the first rank's kernels are counted (the runner of each rank
profiles itself, ``ModelRunner.profile``) and its all-reduce kernels' time is reported apart; in
the eager step that time is mostly an NCCL kernel waiting for the slower rank's host to launch
its side, not the link. So the all-reduces the profiled steps made (``recording_all_reduces``)
are replayed alone, same count, shapes and dtype, with the ranks in step: captured in one CUDA
graph, as in the graphed decode users run (eagerly on gloo, a barrier before each repeat). That
is what a decode step pays for tensor parallelism, also given for the bench's largest batch
(shapes scaled from the counted step's tokens) and as a share of the decode step the bench
measured. On a CPU the rows are the leaf operators the CPU ran: a smoke test, the figures mean
little.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ft.distributed import group_all_reduce, recording_all_reduces

try:  # programmatic dependent launch, switched off while kernels are counted (GPU installs)
    from ft.layers import pdl
except ImportError:  # no triton
    pdl = None
from ft.sampling_params import SamplingParams

TOP = 25
DECODE_STEPS = 4  # profiled, after one unprofiled
CENSUS_TOKENS = DECODE_STEPS + 2  # generated after a census prompt, plus one per sequence in its batch
REPEATS = 20  # timed replays of a step's all-reduces

Call = tuple[tuple[int, ...], torch.dtype]  # one all-reduce: the shape and dtype it sums


@dataclass
class StepAllReduces:
    """The all-reduces of a decode step, timed alone with the ranks in step (``time_all_reduces``)."""

    batch: int
    count: float  # per step
    messages: list[tuple[list[int], str, float]]  # shape, dtype, count per step, in first-use order
    bytes_per_step: float
    ms_per_step: float
    timed: str  # "graphed" (CUDA) or "eager" (gloo)
    scaled: bool = False  # shapes are the counted step's, their tokens set to ``batch``
    step_ms: float | None = None  # the decode step the bench measured at ``batch``
    step_share: float | None = None  # ms_per_step / step_ms


@dataclass
class Census:
    phase: str  # "decode (batch 1)" or "prefill (N tokens)"
    steps: int
    kernels_per_step: float
    device_ms_per_step: float
    wall_ms_per_step: float
    top: list[tuple[str, float, float]] = field(default_factory=list)  # name, per step: count, µs
    # kernels (CPU: operators) whose name says all-reduce, in the eager profile: waits included
    allreduce_ms_per_step: float = 0.0
    allreduce_in_step: list[StepAllReduces] = field(default_factory=list)  # decode, TP > 1


def is_allreduce(name: str) -> bool:
    """NCCL's ``ncclDevKernel_AllReduce_...`` kernels, gloo's ``c10d::allreduce_`` operators."""
    return "allreduce" in name.lower().replace("_", "")


class KernelProfile:
    """``torch.profiler`` over one process's kernels (CUDA) or leaf operators (CPU) from ``begin``
    to ``end``; ``end`` returns per name the count and the microseconds, the wall time, and the
    all-reduces ``ft.distributed.all_reduce`` made (shape and dtype, in order)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.prof, self.t0 = device, None, 0.0
        self.recording, self.calls = None, []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._sync()
        cuda = self.device.type == "cuda"
        # Kernels launched with programmatic dependent launch start before their predecessor ends
        # and wait inside: the profiler would count the wait as theirs. Counted without it.
        self._pdl = pdl.ENABLED if pdl is not None else None
        if pdl is not None:
            pdl.ENABLED = False
        self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        self.recording = recording_all_reduces()
        self.calls = self.recording.__enter__()
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def end(self) -> dict:
        self._sync()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        self.recording.__exit__(None, None, None)
        if pdl is not None:
            pdl.ENABLED = self._pdl
        cuda = self.device.type == "cuda"
        counts, micros = collections.Counter(), collections.Counter()
        for e in self.prof.events():
            if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
                counts[e.name] += 1
                micros[e.name] += e.device_time
            elif not cuda and e.device_type == torch.autograd.DeviceType.CPU and not e.cpu_children:
                counts[e.name] += 1
                micros[e.name] += e.self_cpu_time_total
        self.prof, self.recording = None, None
        return {"counts": dict(counts), "micros": dict(micros), "wall": wall, "all_reduces": self.calls}


def time_all_reduces(calls: list[Call], group, device: torch.device, repeats: int = REPEATS) -> float:
    """Milliseconds the all-reduces ``calls`` take, in order, with every rank in step. On CUDA they
    are captured in one graph, as in a graphed decode step, and replayed after a barrier and a
    warm-up replay, so no rank waits for another's host: the mean of ``repeats`` replays between
    two events. On a CPU (gloo) they run eagerly, a barrier before each timed repeat."""
    buffers = {c: torch.zeros(c[0], dtype=c[1], device=device) for c in set(calls)}  # zeros stay zeros

    def step() -> None:
        for c in calls:
            group_all_reduce(buffers[c], group)  # the path the step's all-reduces take

    step()  # warm-up: communicators and buffers set up outside the timing (and the capture)
    if device.type != "cuda":
        total = 0.0
        for _ in range(repeats):
            dist.barrier(group)
            t0 = time.perf_counter()
            step()
            total += time.perf_counter() - t0
        return total / repeats * 1e3
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    dist.barrier(group)
    torch.cuda.synchronize(device)
    graph.replay()  # the ranks leave the barrier apart by a host's jitter: this replay absorbs it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def dtype_name(dtype: torch.dtype) -> str:
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return short.get(dtype, str(dtype).removeprefix("torch."))


def step_all_reduces(
    executor, calls: list[Call], steps: int, batch: int, timed: str, scaled: bool = False
) -> StepAllReduces:
    """The all-reduces of ``steps`` decode steps (``calls``), timed on every rank, per step."""
    got = executor.profile("all_reduces", calls)  # milliseconds, or why they could not be timed
    if isinstance(got, str):
        timed, ms = f"failed ({got[:200]})", math.nan
    else:
        ms = got / steps
    kinds = collections.Counter(calls)  # first-use order
    messages = [(list(shape), dtype_name(dtype), n / steps) for (shape, dtype), n in kinds.items()]
    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in calls) / steps
    return StepAllReduces(batch, len(calls) / steps, messages, nbytes, ms, timed, scaled)


def _profile(phase: str, executor, run, steps: int) -> tuple[Census, list[Call]]:
    """The census of ``steps`` steps that ``run`` makes, and the all-reduces they made."""
    executor.profile("begin")
    try:
        run()
    finally:
        got = executor.profile("end")
    counts, micros = collections.Counter(got["counts"]), collections.Counter(got["micros"])
    top = [(name, counts[name] / steps, us / steps) for name, us in micros.most_common(TOP)]
    row = Census(
        phase,
        steps,
        sum(counts.values()) / steps,
        sum(micros.values()) / steps / 1e3,
        got["wall"] / steps * 1e3,
        top,
        sum(us for name, us in micros.items() if is_allreduce(name)) / steps / 1e3,
    )
    return row, got["all_reduces"]


def census(
    engine,
    input_len: int,
    decode_steps: int = DECODE_STEPS,
    batch: int = 1,
    decode_step_ms: dict[int, float] | None = None,
) -> list[Census]:
    """Census of a decode step of ``batch`` sequences (after ``input_len``-token prompts) and of
    one such prefill. ``decode_step_ms``: the bench's measured decode step per batch size; with
    tensor parallelism each all-reduce timing is given as a share of its batch's step, and the
    largest batch's all-reduces are timed too."""
    vocab = engine.model_config.vocab_size

    def prompt(seed: int) -> list[int]:  # distinct prompts: no prefix-cache hits
        return [(i * 7919 + seed * 104729 + 13) % vocab for i in range(input_len)]

    def run(tokens: list[int], max_tokens: int) -> str:
        return engine.add_request(
            tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )

    def prefill(seed: int) -> None:
        run(prompt(seed), 1)
        while engine.has_unfinished_requests():
            engine.step()

    # the first sequences decode while the later prompts prefill: up to a token per step each
    rids = [run(prompt(i), decode_steps + 2 + batch) for i in range(batch)]
    while any(r.num_computed_tokens < r.prompt_len for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # the first decode step outside the profile: first-use work
    live = len(engine.scheduler.requests)  # the batch, unless prefill took more steps than that
    steps = lambda: [engine.step() for _ in range(decode_steps)]  # noqa: E731
    decode, calls = _profile(f"decode (batch {live})", engine.executor, steps, decode_steps)
    for rid in rids:
        engine.abort_request(rid)
    prefill(batch)  # shapes compiled and tuned outside the profile
    pre, _ = _profile(f"prefill ({input_len} tokens)", engine.executor, lambda: prefill(batch + 1), 1)
    if calls:
        decode.allreduce_in_step = timed_in_step(engine, calls, decode_steps, live, decode_step_ms or {})
    return [decode, pre]


def timed_in_step(
    engine, calls: list[Call], steps: int, batch: int, step_ms: dict[int, float]
) -> list[StepAllReduces]:
    """The counted decode steps' all-reduces timed in step; and, when the bench measured a larger
    batch, the same all-reduces with its tokens (a decode step's messages lead with its tokens)."""
    timed = "graphed" if engine.cfg.resolved_device.type == "cuda" else "eager"
    out = [step_all_reduces(engine.executor, calls, steps, batch, timed)]
    largest = max(step_ms, default=batch)
    if largest != batch and all(shape and shape[0] == batch for shape, _ in calls):
        wide = [((largest, *shape[1:]), dtype) for shape, dtype in calls]
        out.append(step_all_reduces(engine.executor, wide, steps, largest, timed, scaled=True))
    for s in out:
        if math.isfinite(step_ms.get(s.batch, math.nan)):
            s.step_ms = step_ms[s.batch]
            s.step_share = s.ms_per_step / s.step_ms
    return out


def format_in_step(s: StepAllReduces, counted: int) -> str:
    messages = " + ".join(f"{n:g} x {shape} {dtype}" for shape, dtype, n in s.messages)
    ways = {"graphed": "graphed, ranks in step", "eager": "eager, a barrier before each repeat"}
    how = ways.get(s.timed, s.timed)  # or why they could not be timed
    how += f"; shapes scaled from batch {counted}" if s.scaled else ""
    shared = s.step_share is not None and math.isfinite(s.step_share)
    share = f", {s.step_share:.1%} of the bench's {s.step_ms:,.3f} ms decode step" if shared else ""
    where = "in step" if s.batch == counted else f"in a batch-{s.batch} step"
    size = (
        f"{s.bytes_per_step / 1e6:,.3g} MB"
        if s.bytes_per_step >= 1e5
        else f"{s.bytes_per_step / 1e3:,.3g} kB"
    )
    return f"  all-reduce {where}: {messages} ({size}), {s.ms_per_step:,.3f} ms a step ({how}){share}"


def format_census(rows: list[Census]) -> list[str]:
    lines = []
    for c in rows:
        eager = (
            f", all-reduce kernels {c.allreduce_ms_per_step:,.3f} ms"
            " (eager profile: includes waiting for the slower rank)"
        )
        lines.append(
            f"census {c.phase}: {c.kernels_per_step:,.0f} kernels per step, "
            f"{c.device_ms_per_step:,.3f} ms of kernels, {c.wall_ms_per_step:,.3f} ms wall"
            + (eager if c.allreduce_ms_per_step else "")
        )
        counted = c.allreduce_in_step[0].batch if c.allreduce_in_step else 0
        lines += [format_in_step(s, counted) for s in c.allreduce_in_step]
        for name, count, us in c.top:
            # calls x time a call = time a step (``top`` holds the step's)
            lines.append(f"  {count:7.1f} x {us / count:8.1f} us = {us:10.1f} us a step  {name[:100]}")
    return lines
