"""``ft bench offline``: throughput and latency of the engine on one machine, against the roofline.

Prompts are random token ids. For each batch size N, N prompts of ``input_len`` tokens generate
``output_len`` tokens each: aggregate tok/s is all output tokens over the wall time (prefill
included); decode tok/s is N over the mean time of a pure decode step, compared with the decode
roofline (``ft.bench.roofline``). Also: single-stream decode (output_len / (time − that run's own
first-token time)), TTFT at ``input_len`` (median of 5), and prefill tok/s of one long prompt per
``--prefill-lens``, the TTFT and each prefill beside their compute floor (the prompt's FLOPs over
the dense matmul rate measured on the device, ``roofline.prefill_flops``).

When experts are offloaded (``--moe-backend offload|hybrid|cpu``), each row also gives the decode
steps' expert-cache hit rate (hits over (layer, expert) uses, as EngineStats counts them), the
expert bytes over PCIe per generated token (copied host -> device, and read in place by host
reads), and the PCIe floor: a decode step can be no faster than those bytes over the measured
pinned host -> device bandwidth plus its HBM roofline time. ``--dummy-routing-skews 0,1`` and
``--expert-cache-policies lru,lfu`` measure every combination on one loaded model (the engine
switches in place, ``LLMEngine.set_moe_variant``, and each variant's expert caches start again
from the start-up fill, so no row inherits the one before), one report each.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import torch

from ft import switches as kernel_switches
from ft.bench.census import CENSUS_TOKENS, census
from ft.bench.hf import bench_hf
from ft.bench.report import Report, Row
from ft.bench.roofline import decode_step_bytes, measure_bandwidth, measure_matmul_rate, prefill_flops
from ft.config import EngineConfig
from ft.engine.engine import LLMEngine
from ft.sampling_params import SamplingParams
from ft.scheduler.request import kv_tokens


def _sync(engine: LLMEngine) -> None:
    if (
        engine.executor is not None
        and torch.cuda.is_available()
        and engine.cfg.resolved_device.type == "cuda"
    ):
        torch.cuda.synchronize()


def offloads(engine: LLMEngine) -> bool:
    """Whether the engine's routed experts live off the GPU (a backend other than gpu)."""
    return engine.plan.moe is not None and engine.plan.moe.backend != "gpu"


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Run prompts to completion; returns wall time, first-token time and pure-decode step times,
    and for offloaded experts the decode steps' hit rate and bytes over PCIe per token. The MoE
    counters are read twice a run (before the first decode step of the whole batch and at the
    end), not around every step: reading them resolves the copy timings of every layer, which
    a per-step read added to the wall time the single-stream and aggregate figures measure.
    Nor is the device synchronised after each step (only at the end): a step returns once its
    tokens are read, and a sync there would wait for the decode step issued ahead of them
    (``LLMEngine.step``), serialising what a served engine overlaps."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    start = time.perf_counter()
    first, decode_steps = None, []
    moe = offloads(engine)
    before, clean, tokens = None, True, 0  # MoE counters at the window's start; only decode steps in it
    while engine.has_unfinished_requests():
        decode_only = not engine.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running
        )
        if moe and before is None and decode_only and len(engine.scheduler.running) == len(prompts):
            before = engine.stats()
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        if decode_only and len(engine.scheduler.running) + sum(o.finished for o in outs) == len(prompts):
            decode_steps.append(t1 - t0)
            tokens += len(outs) if before is not None else 0
        elif before is not None:
            clean = False  # a step that was not the whole batch decoding fell inside the window
        if first is None and any(o.token_ids for o in outs):
            first = t1 - start
    _sync(engine)
    out = {"wall": time.perf_counter() - start, "first": first or 0.0, "decode_steps": decode_steps}
    if before is not None and clean and tokens:
        after = engine.stats()
        hits, misses = after.moe_hits - before.moe_hits, after.moe_misses - before.moe_misses
        prefetched = after.moe_prefetched - before.moe_prefetched
        out |= {
            "hit_rate": hits / max(1, hits + misses),
            "h2d_per_token": (after.moe_bytes_pcie - before.moe_bytes_pcie) / tokens,
            "prefetched_per_token": prefetched / tokens,
            "prefetch_used": (after.moe_prefetch_hits - before.moe_prefetch_hits) / max(1, prefetched),
        }
    return out


def measure_h2d(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a pinned host -> device copy (the ceiling for streamed experts)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes * repeats / (time.perf_counter() - t0)


def bench(
    cfg: EngineConfig,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    prefill_lens: list[int],
    seed: int = 0,
    compare_hf: bool = False,
    with_census: bool = False,
    census_batch: int = 1,
    variants: list[tuple[float, str]] | None = None,
    ttft_idle_s: float = 0.0,
    prefill_runs: int = 1,
) -> list[Report]:
    """One report per (routing skew, cache policy) of ``variants`` (default: the config's own),
    measured in that order on one engine; ``ttft_idle_s``: the engine idle before each TTFT run."""
    rng = random.Random(seed)
    engine = LLMEngine(cfg)
    vocab = engine.model_config.vocab_size
    pool = engine.scheduler.blocks.num_tokens
    lengths = [kv_tokens(n, 1) for n in prefill_lens] + [kv_tokens(input_len, output_len + 1)]
    if with_census:  # its prompts decode CENSUS_TOKENS and a token per sequence of its batch
        lengths.append(kv_tokens(input_len, CENSUS_TOKENS + census_batch))
    need = max(lengths)
    if need > pool:  # before any row, not after the others have run
        engine.shutdown()
        raise SystemExit(f"the KV pool holds {pool} tokens, the longest request {need}: raise --num-tokens")

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    from ft.distributed import TPInfo
    from ft.engine.build import build_model

    dtype = cfg.torch_dtype(engine.model_config.dtype)
    meta = build_model(engine.model_config, TPInfo(0, cfg.tp_size), "meta", dtype)
    act_bytes = torch.tensor([], dtype=dtype).element_size()
    device = cfg.resolved_device
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    hbm_gb_s = measure_bandwidth(device) / 1e9
    matmul_tflops = measure_matmul_rate(device) / 1e12
    h2d_gb_s = None
    moe = engine.plan.moe
    offloaded = offloads(engine)
    if offloaded and device.type == "cuda":
        h2d_gb_s = measure_h2d() / 1e9
    reports = []
    for skew, policy in variants or [(cfg.dummy_routing_skew, cfg.expert_cache_policy)]:
        engine.set_moe_variant(policy, skew)
        # the engine's own: decode ahead (``--no-decode-ahead``) beside the kernel switches
        switches = kernel_switches.current() | {"engine:decode_ahead": engine.decodes_ahead}
        report = Report(cfg.model_path, name, hbm_gb_s, matmul_tflops, switches=switches)
        report.ttft_idle_s = ttft_idle_s
        for length in (input_len, *prefill_lens):
            flops = prefill_flops(meta, engine.model_config, length).total
            report.compute_floor_s[length] = flops / (matmul_tflops * 1e12)
        moe = engine.plan.moe
        if moe is not None and moe.layers:
            report.moe = {
                "backend": moe.backend,
                "residency": moe.slots / moe.experts if offloaded else 1.0,
                "slots_per_layer": moe.slots,
                "experts_per_layer": moe.experts,
                "policy": moe.policy,
                "prefetch": moe.prefetch,
                "routing_skew": skew,
            }
            if h2d_gb_s:
                report.moe["h2d_gb_s"] = h2d_gb_s
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        measure(engine, report, meta, act_bytes, prompt, batch_sizes, input_len, output_len, prefill_lens,
                prefill_runs)  # fmt: skip
        if device.type == "cuda":
            report.memory = device_peak(engine, device)
        if with_census:
            steps = {row.batch: 1e3 * row.batch / row.decode_tok_s for row in report.rows}
            report.census = census(engine, input_len, batch=census_batch, decode_step_ms=steps)
        reports.append(report)
    engine.shutdown()
    if compare_hf:
        del engine  # its weights and pools, before transformers builds the same model beside them
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reports[0].hf = bench_hf(cfg, input_len, output_len)
    return reports


def device_peak(engine: LLMEngine, device: torch.device) -> dict:
    """What the run took on ``device`` at its peak against what the plan let it take (its cap ×
    ``--memory-ratio``) and the activation reserve kept inside that (``sizing.reserve_bytes``):
    torch's peak reservation since the last reset plus what lies outside torch's allocator now (the
    CUDA context, cuBLAS workspaces, NCCL), in GiB, and the same with torch's peak of live tensors
    instead: the difference is what the allocator's cache kept (``ft.engine.allocator``); a peak
    below the plan is memory the expert cache could have had."""
    from ft.engine import allocator
    from ft.moe.backends.sizing import GiB, device_cap, plan_bytes, reserve_bytes

    outside, total = allocator.outside(device)
    return {
        "peak_gib": (torch.cuda.max_memory_reserved(device) + outside) / GiB,
        "peak_allocated_gib": (torch.cuda.max_memory_allocated(device) + outside) / GiB,
        "plan_gib": plan_bytes(engine.cfg, device, total) / GiB,
        "reserve_gib": reserve_bytes(device_cap(engine.cfg, device, total)) / GiB,
        "prefill_chunk": engine.plan.prefill_chunk,
    }


def idle_for(engine: LLMEngine, seconds: float) -> tuple[float, float]:
    """Leave the engine idle for ``seconds``, told so as the serving loop tells it once the last
    request's outputs are out (``LLMEngine.idle``); -> (ms of host time ``idle`` took, ms more
    until the copies it issued, if any, landed)."""
    _sync(engine)
    t0 = time.perf_counter()
    engine.idle()
    t1 = time.perf_counter()
    _sync(engine)
    t2 = time.perf_counter()
    time.sleep(max(0.0, seconds - (t2 - t0)))
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1)


def measure(engine: LLMEngine, report: Report, meta, act_bytes: int, prompt, batch_sizes: list[int],
            input_len: int, output_len: int, prefill_lens: list[int],
            prefill_runs: int = 1) -> None:  # fmt: skip
    """Fill ``report``: single stream, TTFT, a row per batch size, prefill rates."""
    run_batch(engine, [prompt(min(input_len, 32))], 4)  # warm-up: autotuning, allocator
    single = run_batch(engine, [prompt(input_len)], output_len + 1)
    report.single_stream_tok_s = output_len / (single["wall"] - single["first"])
    report.ttft_runs_ms = []
    for _ in range(5):
        if report.ttft_idle_s:  # a request that finds the engine idle, as an interactive user's does
            report.idle_hook_ms.append(idle_for(engine, report.ttft_idle_s))
        used = engine.stats().moe_prestaged_layers
        report.ttft_runs_ms.append(1e3 * run_batch(engine, [prompt(input_len)], 1)["wall"])
        report.ttft_prestaged_layers.append(engine.stats().moe_prestaged_layers - used)
    report.ttft_ms, report.ttft_input_len = statistics.median(report.ttft_runs_ms), input_len
    for n in batch_sizes:
        run_batch(engine, [prompt(input_len) for _ in range(n)], 2)  # warm-up: kernels tuned for these shapes
        res = run_batch(engine, [prompt(input_len) for _ in range(n)], output_len)
        step = statistics.mean(res["decode_steps"]) if res["decode_steps"] else float("nan")
        sb = decode_step_bytes(meta, engine.model_config, n, input_len + output_len // 2, act_bytes)
        step_gb = sb.total / 1e9
        roof_tok_s = n / (sb.total / (report.hbm_gb_s * 1e9))
        row = Row(n, n * output_len / res["wall"], n / step, roof_tok_s, step_gb, res["wall"])
        if "hit_rate" in res:
            row.moe_hit_rate, row.moe_mb_per_token = res["hit_rate"], res["h2d_per_token"] / 1e6
            if res["prefetched_per_token"]:
                row.moe_prefetched_per_token = res["prefetched_per_token"]
                row.moe_prefetch_used = res["prefetch_used"]
            h2d = report.moe.get("h2d_gb_s")
            if h2d:  # copied bytes over PCIe plus the HBM floor of the rest of the step
                step_floor = n * res["h2d_per_token"] / (h2d * 1e9) + sb.total / (report.hbm_gb_s * 1e9)
                row.pcie_floor_tok_s = n / step_floor
        report.rows.append(row)
    for length in prefill_lens:
        run_batch(engine, [prompt(length)], 1)  # warm-up
        runs = []
        for _ in range(prefill_runs):  # fresh prompts: nothing from the prefix cache
            before = engine.stats() if offloads(engine) else None
            res = run_batch(engine, [prompt(length)], 1)
            # what the link carried for it (issue 8 asks >= 85% of its bandwidth)
            streamed = engine.stats().moe_bytes_pcie - before.moe_bytes_pcie if before is not None else 0.0
            runs.append((length / res["wall"], streamed))
        rate, streamed = sorted(runs)[len(runs) // 2]
        report.prefill[length] = rate
        if offloads(engine):
            report.prefill_streamed[length] = streamed
        if prefill_runs > 1:
            report.prefill_runs[length] = runs
