"""How much memory the offloading MoE backends take: numbers only, decided before allocating.

- Host: R static experts per layer (a lean store, ``placement.py``): ``--static-experts``, else
  none when the host holds every expert, else the fewest that let it hold the rest
  (``static_experts``; what a host holds is ``host_store.host_experts``).
- GPU: S cache slots per layer (``cache_slots``). The budget is ``min(total, --max-gpu-memory) *
  --memory-ratio`` minus what the device already holds (the dense weights, allocated when the
  model is built). After the KV and state pools a reserve is kept for activations and CUDA
  graphs (``reserve_bytes``), the staging buffers are taken, and the rest becomes S slots in
  every MoE layer, each layer also holding its null row. A lean store's S is decided before the
  pools exist, so their planned size is subtracted in advance, and S must hold the R static
  experts and one token's k others; otherwise the engine stops before loading, with the figures.
"""

from __future__ import annotations

import gc
import os

import torch

from ft.config import EngineConfig
from ft.moe.backends.host_store import GiB
from ft.moe.backends.layout import ExpertLayout

STAGING_BYTES = 256 << 20  # per staging buffer: enough to keep PCIe busy while a group computes
# Staging buffers a rank streams through (FT_MOE_STAGING_BUFFERS for a process and the ranks it
# spawns): with streaming ahead each holds one of the next layer's first groups, so the link keeps
# copying while that layer's mixer and router run, until every buffer is full. A third measured
# nothing once a layer computes its first staged group before its hits (``streaming.HITS_AFTER_AHEAD``):
# the 16-layer cut's 8k prefill on an H200, 2026-12-03, 392.6 ms with two, 395.9 with three,
# the link busy 98% of the profiled time either way (docs/benchmarks.md). Two, for 256 MiB more
# of expert cache.
STAGING_BUFFERS = max(2, int(os.environ.get("FT_MOE_STAGING_BUFFERS", "2")))


def reserve_bytes(cap: int) -> int:
    """Kept free for activations (a prefill chunk) and CUDA graphs after every pool is allocated."""
    return max(2 * GiB, cap // 20)


DEFAULT_PREFILL_CHUNK = 8192  # tokens a prefill chunk takes (--chunked-prefill-size) ...
OFFLOAD_PREFILL_CHUNK = 32768  # ... and the most it grows to when the experts stream
GRAPH_MARGIN = 1 << 30  # of the activation reserve, kept for CUDA graphs and the allocator's slack


DEFAULT_RUNNING = 64  # --max-running-requests when not given ...
STATE_SHARE = 32  # ... or, when the experts stream, what GDN state rows fit 1 / STATE_SHARE of the cap


def default_running(cap: int | None, row_bytes: int, fixed_rows: int, rows_per_request: int) -> int:
    """``--max-running-requests`` when not given: ``DEFAULT_RUNNING``; with the experts streaming
    (``cap``: the device's, else None) on a hybrid model (``row_bytes``: a GDN state row, 0
    without), the most, a power of two from 4 up to the default, whose rows fit ``cap /
    STATE_SHARE`` beside ``fixed_rows`` (the scratch row, and the prefix snapshots when their
    count is given), ``rows_per_request`` a request (its slot, and its snapshot when their count
    follows). Every row comes out of the expert cache: on the 80B a row is ~72 MB, so 64
    requests' 129 rows took 9.3 GiB, a third of the cache under --max-gpu-memory 48GiB; there the
    default is now 8 (1.2 GiB), on a 141 GB H200 16."""
    if cap is None or row_bytes == 0:
        return DEFAULT_RUNNING
    fit = (cap // STATE_SHARE // row_bytes - fixed_rows) // rows_per_request
    n = 4
    while n * 2 <= min(fit, DEFAULT_RUNNING):
        n *= 2
    return n


def activation_bytes_per_token(mc, dtype_bytes: int = 2) -> int:
    """A generous bound on a prefill's live activations per token: the residual stream (or the
    hyper-connections' streams) and its norms and copies, the widest mixer projection thrice
    (its output, a split and the kernel's own), the MoE pairs (each token's k gathered inputs,
    outputs and gate/up activations, as the streamed layer's in-place call holds them) and the
    streamed layer's terms by pair, the shared expert's beside them (``pairs.Terms``)."""
    h, k = mc.hidden_size, max(1, mc.num_experts_per_tok)
    inter = mc.moe_intermediate_size or mc.intermediate_size
    attn = (mc.num_heads * (2 if mc.attn_output_gate else 1) + 2 * mc.num_kv_heads) * mc.head_dim
    keys = mc.linear_num_key_heads * mc.linear_key_head_dim
    gdn = 2 * (2 * keys + 2 * mc.linear_num_value_heads * mc.linear_value_head_dim)  # qkvz and its split
    widest = max(attn, gdn, 2 * mc.intermediate_size)
    streams = max(1, mc.hc_mult)  # hyper-connections carry that many residual streams (qwen4_exp)
    return dtype_bytes * (16 * h * streams + 3 * widest + k * (2 * h + 2 * inter) + (k + 1) * h)


def prefill_chunk(cfg: EngineConfig, mc, device: torch.device, streams: bool) -> int:
    """Tokens a prefill chunk takes: ``--chunked-prefill-size`` when given; else, when the
    experts stream (``streams``: offload, hybrid), the largest power of two up to ``OFFLOAD_PREFILL_CHUNK``
    whose activations fit what the plan keeps free (``reserve_bytes`` less ``GRAPH_MARGIN``),
    because every chunk streams every host expert once: in 8k chunks a 32k prompt streams the
    full 80B's 36 GB of bf16 host experts four times (an 8k chunk took 1.06 s on an H200,
    docs/benchmarks.md, 2026-12-01); otherwise ``DEFAULT_PREFILL_CHUNK``. The price: a hybrid
    model's prefix cache keeps one GDN snapshot a chunk, so a shared prefix resumes at chunk
    boundaries, 16k apart instead of 8k."""
    if cfg.max_num_batched_tokens is not None:
        return cfg.max_num_batched_tokens
    if not streams or device.type != "cuda":
        return DEFAULT_PREFILL_CHUNK
    room = reserve_bytes(device_cap(cfg, device)) - GRAPH_MARGIN
    return grown_chunk(room, activation_bytes_per_token(mc))


def grown_chunk(room: int, per_token: int) -> int:
    """The largest power of two from ``DEFAULT_PREFILL_CHUNK`` up to ``OFFLOAD_PREFILL_CHUNK``
    whose activations (``per_token`` bytes each) fit ``room`` bytes; the default if none does."""
    chunk = DEFAULT_PREFILL_CHUNK
    while chunk * 2 <= OFFLOAD_PREFILL_CHUNK and chunk * 2 * per_token <= room:
        chunk *= 2
    return chunk


def device_memory(cfg: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(bytes the engine may still allocate on ``device`` now, the cap it plans for); CUDA only.
    Blocks torch's caching allocator holds but no tensor uses (an engine closed earlier in this
    process) go back to the driver first: the driver counts them used, and counting them free
    instead over-commits, since a large tensor cannot be carved from scattered cached blocks."""
    gc.collect()  # an engine closed earlier, still held by a reference cycle
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return plan_bytes(cfg, device, total) - (total - free), device_cap(cfg, device, total)


def device_cap(cfg: EngineConfig, device: torch.device, total: int | None = None) -> int:
    """What the engine plans for on ``device``: its memory, or ``--max-gpu-memory`` if smaller."""
    total = torch.cuda.mem_get_info(device)[1] if total is None else total
    return min(total, cfg.max_gpu_memory_bytes or total)


def plan_bytes(cfg: EngineConfig, device: torch.device, total: int | None = None) -> int:
    """What the engine may use on ``device`` in all: its cap (``device_cap``) x ``--memory-ratio``."""
    return int(device_cap(cfg, device, total) * cfg.memory_ratio)


def device_budget(cfg: EngineConfig, device: torch.device) -> int:
    return device_memory(cfg, device)[0]


def staging_rows(cfg: EngineConfig, layout: ExpertLayout, e: int) -> int:
    """Experts per staging buffer (there are ``STAGING_BUFFERS``)."""
    return min(e, cfg.moe_staging_experts or max(1, STAGING_BYTES // layout.expert_bytes))


def staging_bytes(cfg: EngineConfig, layout: ExpertLayout, e: int) -> int:
    """What every staging buffer of a rank takes together."""
    return STAGING_BUFFERS * staging_rows(cfg, layout, e) * layout.expert_bytes


def static_experts(cfg: EngineConfig, backend: str, e: int, fit: int) -> int:
    """R for a layer of ``e`` experts on a host that holds ``fit`` of them (at least one is left
    to the host: below that ``check_host_memory`` refuses, with the figures)."""
    forced = cfg.static_experts
    if backend == "cpu":
        if forced:
            raise ValueError(
                f"--static-experts {forced}: the cpu backend computes every routed expert on the CPU "
                "from the host store, so none can live on the GPU only; use --moe-backend offload or hybrid"
            )
        return 0
    if forced is not None:
        if forced >= e:
            raise ValueError(
                f"--static-experts {forced}: a layer has {e} experts and at least one must stay dynamic "
                "(to keep them all on the GPU: --moe-backend gpu)"
            )
        return forced
    return 0 if fit >= e else e - max(1, fit)


def cache_slots(
    cfg: EngineConfig,
    device: torch.device,
    layout: ExpertLayout,
    layers: int,
    e: int,
    top_k: int,
    staging_bytes: int,
    pool_bytes: int = 0,
    static: int = 0,
) -> int:
    """S: from --expert-cache-fraction, else what the GPU budget leaves (every expert on a CPU-only
    machine). ``pool_bytes``: pools planned but not yet allocated (a lean store's S)."""
    r = static
    frac = cfg.expert_cache_fraction
    if frac is not None:
        slots = min(e, max(1, round(frac * e)))
        if slots <= r:
            raise ValueError(
                f"--expert-cache-fraction {frac} gives {slots} slots per layer, no more than its {r} "
                "static experts: none is left for the others"
            )
        return slots
    if device.type != "cuda":
        return e  # nothing to measure on a CPU-only machine: cache everything
    budget, cap = device_memory(cfg, device)
    reserve = reserve_bytes(cap)
    left = budget - pool_bytes - reserve - staging_bytes
    per_slot = layers * layout.expert_bytes
    slots = left // per_slot - 1  # each layer also holds its null row
    if r == 0 and slots < 1:
        raise MemoryError(
            f"no room for an expert cache: {left / GiB:.2f} GiB left on {device} after weights, "
            f"KV and state pools, {reserve / GiB:.1f} GiB reserve and "
            f"{staging_bytes / GiB:.2f} GiB staging, and one slot in each of {layers} layers takes "
            f"{2 * per_slot / GiB:.2f} GiB; lower --num-tokens or raise --memory-ratio / --max-gpu-memory"
        )
    need = r + min(top_k, e - r)  # the static experts and one token's others
    if r and slots < need:
        raise MemoryError(
            f"the host holds {e - r} of the {e} experts of each layer, so {r} must live on {device} "
            f"only, beside {need - r} slots for the others: {need + 1} rows in each of {layers} layers "
            f"take {(need + 1) * per_slot / GiB:.2f} GiB, but {left / GiB:.2f} GiB is left after "
            f"weights, {pool_bytes / GiB:.2f} GiB of KV and state pools, {reserve / GiB:.1f} GiB "
            f"reserve and {staging_bytes / GiB:.2f} GiB staging. Use more tensor-parallel ranks, NVFP4 "
            "experts (--quantize-experts nvfp4), lower --num-tokens, or raise --memory-ratio / "
            "--max-gpu-memory / --max-host-memory"
        )
    return min(e, slots)
