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

import torch

from ft.config import EngineConfig
from ft.moe.backends.host_store import GiB
from ft.moe.backends.layout import ExpertLayout

STAGING_BYTES = 256 << 20  # per staging buffer: enough to keep PCIe busy while a group computes


def reserve_bytes(cap: int) -> int:
    """Kept free for activations (a prefill chunk) and CUDA graphs after every pool is allocated."""
    return max(2 * GiB, cap // 20)


def device_memory(cfg: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(bytes the engine may still allocate on ``device`` now, the cap it plans for); CUDA only.
    Blocks torch's caching allocator holds but no tensor uses (an engine closed earlier in this
    process) go back to the driver first: the driver counts them used, and counting them free
    instead over-commits, since a large tensor cannot be carved from scattered cached blocks."""
    gc.collect()  # an engine closed earlier, still held by a reference cycle
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    cap = min(total, cfg.max_gpu_memory_bytes or total)
    return int(cap * cfg.memory_ratio) - (total - free), cap


def device_budget(cfg: EngineConfig, device: torch.device) -> int:
    return device_memory(cfg, device)[0]


def staging_rows(cfg: EngineConfig, layout: ExpertLayout, e: int) -> int:
    """Experts per staging buffer (there are two: double-buffered)."""
    return min(e, cfg.moe_staging_experts or max(1, STAGING_BYTES // layout.expert_bytes))


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
