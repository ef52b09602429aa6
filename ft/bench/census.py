"""Kernel census (``ft bench offline --census``): what one decode step and one prefill launch,
counted and timed by ``torch.profiler``. Decode is bound by how many kernels a step launches, not
by bytes, so this table is what to read before fusing anything, and after, to see it worked.

For each phase: kernels per step, their summed device time, the step's wall time, and the kernels
that take the most time with their counts. CUDA graphs are bypassed while counting (a replay is
one launch to the profiler), so the decode rows are the eager step's kernels, which are the
graph's. With tensor parallelism the first rank's kernels are counted (the runner of each rank
profiles itself, ``ModelRunner.profile``), and the time its all-reduces took is reported apart:
what a step pays for tensor parallelism. On a CPU the rows are the leaf operators the CPU ran: a
smoke test, the figures mean little.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

from ft.sampling_params import SamplingParams

TOP = 25
DECODE_STEPS = 4  # profiled, after one unprofiled
CENSUS_TOKENS = DECODE_STEPS + 2  # generated after a census prompt, plus one per sequence in its batch


@dataclass
class Census:
    phase: str  # "decode (batch 1)" or "prefill (N tokens)"
    steps: int
    kernels_per_step: float
    device_ms_per_step: float
    wall_ms_per_step: float
    top: list[tuple[str, float, float]] = field(default_factory=list)  # name, per step: count, µs
    allreduce_ms_per_step: float = 0.0  # kernels (CPU: operators) whose name says all-reduce


def is_allreduce(name: str) -> bool:
    """NCCL's ``ncclDevKernel_AllReduce_...`` kernels, gloo's ``c10d::allreduce_`` operators."""
    return "allreduce" in name.lower().replace("_", "")


class KernelProfile:
    """``torch.profiler`` over one process's kernels (CUDA) or leaf operators (CPU) from ``begin``
    to ``end``; ``end`` returns per name the count and the microseconds, and the wall time."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.prof, self.t0 = device, None, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._sync()
        cuda = self.device.type == "cuda"
        self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def end(self) -> dict:
        self._sync()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        cuda = self.device.type == "cuda"
        counts, micros = collections.Counter(), collections.Counter()
        for e in self.prof.events():
            if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
                counts[e.name] += 1
                micros[e.name] += e.device_time
            elif not cuda and e.device_type == torch.autograd.DeviceType.CPU and not e.cpu_children:
                counts[e.name] += 1
                micros[e.name] += e.self_cpu_time_total
        self.prof = None
        return {"counts": dict(counts), "micros": dict(micros), "wall": wall}


def _profile(phase: str, executor, run, steps: int) -> Census:
    executor.profile("begin")
    try:
        run()
    finally:
        got = executor.profile("end")
    counts, micros = collections.Counter(got["counts"]), collections.Counter(got["micros"])
    top = [(name, counts[name] / steps, us / steps) for name, us in micros.most_common(TOP)]
    return Census(
        phase,
        steps,
        sum(counts.values()) / steps,
        sum(micros.values()) / steps / 1e3,
        got["wall"] / steps * 1e3,
        top,
        sum(us for name, us in micros.items() if is_allreduce(name)) / steps / 1e3,
    )


def census(engine, input_len: int, decode_steps: int = DECODE_STEPS, batch: int = 1) -> list[Census]:
    """Census of a decode step of ``batch`` sequences (after ``input_len``-token prompts) and of
    one such prefill."""
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
    decode = _profile(f"decode (batch {live})", engine.executor, steps, decode_steps)
    for rid in rids:
        engine.abort_request(rid)
    prefill(batch)  # shapes compiled and tuned outside the profile
    return [decode, _profile(f"prefill ({input_len} tokens)", engine.executor, lambda: prefill(batch + 1), 1)]


def format_census(rows: list[Census]) -> list[str]:
    lines = []
    for c in rows:
        lines.append(
            f"census {c.phase}: {c.kernels_per_step:,.0f} kernels per step, "
            f"{c.device_ms_per_step:,.3f} ms of kernels, {c.wall_ms_per_step:,.3f} ms wall"
            + (f", all-reduce {c.allreduce_ms_per_step:,.3f} ms" if c.allreduce_ms_per_step else "")
        )
        for name, count, us in c.top:
            lines.append(f"  {count:7.1f} x {us:10.1f} us  {name[:100]}")
    return lines
