"""Where the hybrid backend's time goes, prefill and decode, on a cut of a model (not a test):

    python tests/gpu/profile_hybrid.py CONFIG LAYERS CACHE_FRACTION [OUT.log]

Builds the config cut to LAYERS layers with dummy weights and ``--moe-backend hybrid`` at the
given expert-cache fraction (0.77: the full bf16 Qwen3-Next-80B's share on one H200), prefix
caching off. Prefill: after an unmeasured one of each kind, 1k and 8k prompts of their own, one
step each, with the host CPU's share of the streamed experts on, off, off, on
(``hybrid.PREFILL_CPU``): the step's wall, the pairs the CPU took and its time on them. Decode
at batch 1 after a 1k prompt: the step's wall, the host time of the hybrid's parts (the graph
break's work, the CPU's experts, the copies issued), then ``torch.profiler`` over a few steps:
the host operators by self time, the kernels' and copies' time and the GPU's idle time.
``DEV=cpu`` runs it on the CPU (a smoke test).
"""

from __future__ import annotations

import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.moe.backends import hybrid, offload, transfer  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.profile_offload_decode import log_profile, timed  # noqa: E402
from tests.gpu.profiling import cut_config, log_parts, logger, time_steps  # noqa: E402

DEVICE = os.environ.get("DEV", "cuda")
PARTS = [
    (hybrid.HybridBackend, "_split_work"),  # a decode layer's graph break: all of the below
    (offload.OffloadBackend, "_route"),  # reading the ids: waits for the segment
    (hybrid.HybridBackend, "_cached"),
    (transfer.Transfer, "issue_many"),  # every copy: misses into the cache, the prefetch
    (hybrid.CpuShare, "start"),  # prefill: the CPU's rows to the host
    (hybrid.CpuShare, "add_to"),  # prefill: the CPU's share computed, once the GPU's work is issued
    (hybrid, "cpu_experts"),  # decode: the misses, at the break
]
if DEVICE == "cuda":
    PARTS.append((torch.cuda.CUDAGraph, "replay"))


def main() -> None:
    src, layers, cache = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    log = logger(sys.argv[4] if len(sys.argv) > 4 else None)
    path, cfg = cut_config(src, layers)
    seconds, calls = timed(PARTS)
    engine = LLMEngine(EngineConfig(
        config_file=path, load_format="dummy", device=DEVICE, num_tokens=20000, max_running_requests=8,
        max_model_len=8200, progress=False, moe_backend="hybrid", expert_cache_fraction=cache,
        enable_prefix_cache=False,  # every prefill computes its whole prompt
    ))  # fmt: skip
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    vocab = cfg["vocab_size"]
    shared = engine.stats

    def prompt(n: int, seed: int) -> list[int]:
        return [(seed * 7919 + i * 31) % vocab for i in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill(n: int, seed: int) -> float:
        engine.add_request(prompt(n, seed), one)
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        return time.perf_counter() - t0

    lens = (1024, 8000) if DEVICE == "cuda" else (64,)
    for n in lens:  # unmeasured: both paths' kernels compiled for the shapes
        for on in (True, False):
            hybrid.PREFILL_CPU = on
            prefill(n, 1)
    runs = [(n, on) for n in lens for on in (True, False, False, True)]  # each order once
    for i, (n, on) in enumerate(runs):
        hybrid.PREFILL_CPU = on
        seconds.clear()
        calls.clear()
        pairs0 = shared().moe_cpu_pairs
        wall = prefill(n, 2 + i)  # a prompt of its own
        log(f"== prefill {n} tokens, CPU share {'on' if on else 'off'}: {wall * 1e3:.1f} ms "
            f"({n / wall:,.0f} tok/s), {shared().moe_cpu_pairs - pairs0} pairs on the CPU")  # fmt: skip
        log_parts(log, seconds, calls, 1)
    hybrid.PREFILL_CPU = False  # the default; decode does not take the share
    steps = 24 if DEVICE == "cuda" else 4
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt(1024, 3), params)
    wall = time_steps(engine, steps, sync, (seconds, calls), warmup=6)
    log(f"== decode, batch 1: step {wall * 1e3:.2f} ms ({1 / wall:.1f} tok/s), "
        f"{wall / layers * 1e6:.0f} us a layer")  # fmt: skip
    log_parts(log, seconds, calls, steps)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = time_steps(engine, 4, sync)
    ops = collections.Counter()
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            ops[e.key[:60]] = e.self_cpu_time_total
    log(f"host operators by self time, per profiled step (wall {wall * 1e3:.2f} ms):")
    for name, us in ops.most_common(14):
        log(f"  {us / 4e3:7.3f} ms  {name}")
    if DEVICE == "cuda":
        log_profile(log, prof, wall, 4)
    s = shared()
    log(f"hits {s.moe_hits}, misses {s.moe_misses}, prefetched {s.moe_prefetched}, "
        f"{s.moe_bytes_h2d / 1e9:.2f} GB copied, {s.moe_cpu_pairs} pairs on the CPU")  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    main()
