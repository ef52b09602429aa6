"""The admission phase of a 64-prompt batch, step by step (not a test):

    python tests/gpu/profile_mixed_steps.py CONFIG [OUT.log]

Admits 64 prompts of 1,024 tokens (dummy weights, the config as given): the first steps are
prefill chunks alone, the later ones chunks beside the first sequences' decodes. Prints each
step's wall time and sequences, a ``torch.profiler`` table of one mixed step's kernels, and one
8,000-token prefill for comparison: the N=64 aggregate of ``ft bench offline`` spends about
twice a plain prefill's time per step here (docs/benchmarks.md, 2026-11-30). ``DEV=cpu`` runs
it on the CPU (a smoke test)."""

from __future__ import annotations

import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.profiling import logger  # noqa: E402

DEVICE = os.environ.get("DEV", "cuda")
CUDA = DEVICE == "cuda"


def main() -> None:
    log = logger(sys.argv[2] if len(sys.argv) > 2 else None)

    engine = LLMEngine(EngineConfig(
        config_file=sys.argv[1], load_format="dummy", device=DEVICE, num_tokens=100000,
        max_running_requests=64, max_model_len=8192, progress=False,
    ))  # fmt: skip
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def admission(seed: int, profile_step: int | None = None) -> list[tuple[float, int]]:
        for j in range(64):  # distinct prompts: no prefix-cache hits
            engine.add_request([(seed * 7919 + j * 104729 + i * 31) % vocab for i in range(1024)], params)
        rows = []
        while any(r.num_computed_tokens < r.prompt_len for r in engine.scheduler.requests.values()):
            sync()
            t0 = time.perf_counter()
            if len(rows) == profile_step:
                with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
                    outs = engine.step()
                    sync()
                log_kernels(prof)
            else:
                outs = engine.step()
                sync()
            rows.append((time.perf_counter() - t0, len(outs)))
        while engine.has_unfinished_requests():
            engine.step()
        return rows

    def log_kernels(prof) -> None:
        kind = torch.autograd.DeviceType.CUDA if CUDA else torch.autograd.DeviceType.CPU
        us, count = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == kind and (CUDA or not e.cpu_children):
                us[e.name[:90]] += e.device_time if CUDA else e.self_cpu_time_total
                count[e.name[:90]] += 1
        log(f"  a mixed step: {sum(count.values())} kernels, {sum(us.values()) / 1e3:.1f} ms of kernels")
        for name, t in us.most_common(15):
            log(f"    {count[name]:5d} x {t / 1e3:8.2f} ms  {name}")

    admission(1)  # shapes compiled outside the measurement
    rows = admission(2)
    log(f"admission of 64 x 1k prompts: {len(rows)} steps, {sum(r[0] for r in rows) * 1e3:.0f} ms; "
        "per step (ms/sequences): " + ", ".join(f"{w * 1e3:.0f}/{n}" for w, n in rows))  # fmt: skip
    admission(3, profile_step=3)
    engine.add_request([(i * 31 + 7) % vocab for i in range(8000)], SamplingParams(max_tokens=1))
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    log(f"one 8,000-token prefill: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    engine.shutdown()


if __name__ == "__main__":
    main()
