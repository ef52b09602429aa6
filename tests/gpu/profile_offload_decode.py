"""Where a layer's time goes in a batch-1 offload decode step (not a test):

    python tests/gpu/profile_offload_decode.py CONFIG LAYERS CACHE [OUT.log]

Builds the config cut to LAYERS layers with dummy weights and the offload backend with CACHE
either an expert-cache fraction (0.6) or a GPU budget (40GiB, ``--max-gpu-memory``), decodes
after a 1k prompt, and prints per decode step the host time of each part: the copying path's
graph breaks (ids to the host, slot decisions, copy issue, the next layer's prefetch, segment
replays) or host reads' between-step work (counting, promotions, publishing the routes), the
step's wall time, and, from ``torch.profiler``, its kernel and copy time, the time the GPU sat
idle, and the costliest kernels. At batch 1 the PCIe floor is the copies (or the host rows the
MoE GEMV reads); what the wall has beyond the kernels is host time. ``DEV=cpu`` runs it on the
CPU (a smoke test); ``QUANT=nvfp4`` quantises the experts while loading; ``BATCH=N`` decodes N
requests at once (8: the copying path where host reads take only small batches); ``POLICY=lfu``
picks the cache policy. Last, the link's time beside the compute's and the kernels that run while
it idles (``profiling.link_timeline``: what copies could still hide behind), and the busiest
stream's critical path by kernel (``profiling.critical_path``)."""

from __future__ import annotations

import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.moe.backends import expert_cache, host_reads, offload, prefetch, slot_map, transfer  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.profiling import critical_path, cut_config, link_timeline, log_parts, logger, time_steps  # noqa: E402

DEVICE = os.environ.get("DEV", "cuda")
BATCH = int(os.environ.get("BATCH", "1"))
PARTS = [
    (offload.OffloadBackend, "_resolve"),  # a break: all below but the prefetch and replays
    (offload.OffloadBackend, "_route"),  # reading the ids: waits for the segment
    (offload.OffloadBackend, "_make_resident"),
    (offload.OffloadBackend, "copy_in"),
    (slot_map.SlotMap, "ensure"),
    (slot_map.SlotMap, "prefetch"),
    (prefetch.Prefetch, "start"),  # the next layer's prefetch, after the next segment's launch
    (host_reads.HostReads, "before_step"),  # host reads: every layer's routes (Tables.publish)
    (host_reads.HostReads, "after_step"),  # host reads: counting and promotions
    (host_reads.HostReads, "_count_and_promote"),
    (transfer.Transfer, "issue_many"),  # every copy (the promotions' too)
    (expert_cache.ExpertCache, "publish"),  # a layer's own (the copying path)
    (expert_cache.Tables, "publish"),  # every layer's at once (host reads)
]
if DEVICE == "cuda":
    PARTS.append((torch.cuda.CUDAGraph, "replay"))


def timed(parts):
    """Wrap each (class, method), or (module, function) that callers look up at call time, to add
    its wall time and calls into the returned counters."""
    seconds, calls = collections.Counter(), collections.Counter()
    for cls, name in parts:
        fn, key = getattr(cls, name), f"{cls.__name__.rsplit('.', 1)[-1]}.{name}"  # a class or a module

        def wrapper(*args, _fn=fn, _key=key, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_key] += time.perf_counter() - t0
                calls[_key] += 1

        setattr(cls, name, wrapper)
    return seconds, calls


def main() -> None:
    src, layers, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    log = logger(sys.argv[4] if len(sys.argv) > 4 else None)
    path, cfg = cut_config(src, layers)
    seconds, calls = timed(PARTS)
    budget = {"max_gpu_memory": cache} if cache[-1].isalpha() else {"expert_cache_fraction": float(cache)}
    engine = LLMEngine(EngineConfig(
        config_file=path, load_format="dummy", device=DEVICE, num_tokens=20000, max_running_requests=8,
        max_model_len=4096, progress=False, moe_backend="offload", quantize_experts=os.environ.get("QUANT"),
        expert_cache_policy=os.environ.get("POLICY", "lru"),
        **budget,
    ))  # fmt: skip
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    vocab, steps = cfg["vocab_size"], 40
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for seed in range(2):
        for b in range(BATCH):
            engine.add_request([(seed * 7919 + b * 104729 + i * 31) % vocab for i in range(1024)], params)
        wall = time_steps(engine, steps, sync, (seconds, calls), warmup=6 + BATCH)
        log(f"== run {seed}: {layers} layers, cache {cache}, batch {BATCH}: decode step {wall * 1e3:.2f} ms "
            f"({BATCH / wall:.1f} tok/s), {wall / layers * 1e6:.0f} us a layer")  # fmt: skip
        log_parts(log, seconds, calls, steps)
        while engine.has_unfinished_requests():
            engine.step()
    s = engine.stats()
    log(f"hits {s.moe_hits}, misses {s.moe_misses}, prefetched {s.moe_prefetched}, "
        f"prefetch hits {s.moe_prefetch_hits}, {s.moe_bytes_h2d / 1e9:.2f} GB copied, "
        f"{s.moe_bytes_host_read / 1e9:.2f} GB read in place")  # fmt: skip
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for b in range(BATCH):
            engine.add_request([(i * 37 + 5 + b) % vocab for i in range(1024)], params)
        for _ in range(6 + BATCH):
            engine.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = time_steps(engine, 4, sync)
        log_profile(log, prof, wall, 4)
        trace = f"/tmp/ft_offload_decode_{os.getpid()}.json"
        prof.export_chrome_trace(trace)
        for line in link_timeline(trace, 4) + critical_path(trace, 4):
            log(line)
    engine.shutdown()


def log_profile(log, prof, wall: float, steps: int) -> None:
    """The profiled steps' kernel and copy time, the GPU's idle time (the wall less the union of
    its busy intervals) and the costliest kernels, each per step."""
    busy, by_name, spans = collections.Counter(), collections.Counter(), []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = "copies" if "Memcpy" in e.name or "Memset" in e.name else "kernels"
            busy[kind] += e.device_time
            by_name[e.name[:60]] += e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    covered, end = 0.0, float("-inf")
    for a, b in sorted(spans):  # the union of the busy intervals (copies overlap kernels)
        covered += max(0.0, b - max(a, end))
        end = max(end, b)
    per = steps * 1e3
    log(f"profiled decode step: wall {wall * 1e3:.2f} ms, kernels {busy['kernels'] / per:.2f} ms, "
        f"copies {busy['copies'] / per:.2f} ms, GPU busy {covered / per:.2f} ms, "
        f"idle {wall * 1e3 - covered / per:.2f} ms")  # fmt: skip
    for name, us in by_name.most_common(8):
        log(f"  {us / per:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
