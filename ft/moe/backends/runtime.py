"""MoeRuntime: the MoE backend of one rank, chosen once and set up around the model runner.

The runner calls it in this order:

    MoeRuntime(cfg, mc, tp, device, dtype)   picks the backend (auto: gpu if the model fits the
                                             GPU budget, else offload, and says so)
    build_model(..., bank_device=rt.bank_device)   offloading: banks built on meta
    rt.attach_stores(model)                  checks host memory, then allocates one host block
                                             per layer and makes the banks' parameters views of
                                             it, so loading fills host memory directly
    load weights / dummy weights; KV and state pools
    rt.allocate(model)                       sizes the slot cache from what is left (or
                                             --expert-cache-fraction), allocates slots and
                                             staging, gives every MoE block its backend
    rt.describe(kv_tokens)                   the plan line each rank prints

The GPU budget is ``min(total, --max-gpu-memory) * --memory-ratio`` minus what the device
already holds. After weights, KV and states, a reserve is kept for activations and CUDA graphs
(``RESERVE``), the staging buffers are taken, and the rest becomes S slots in every MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.config import EngineConfig
from ft.distributed import TPInfo
from ft.models.config import ModelConfig
from ft.moe.backends import OFFLOADING
from ft.moe.backends.cpu import CpuBackend
from ft.moe.backends.expert_cache import ExpertCache, SlotMap
from ft.moe.backends.host_store import GiB, HostStore, check_host_memory, local_ranks, pin_available
from ft.moe.backends.hybrid import HYBRID_MAX_TOKENS, HybridBackend
from ft.moe.backends.layout import ExpertLayout
from ft.moe.backends.offload import OffloadBackend, Shared, Staging
from ft.moe.backends.prefetch import Prefetch
from ft.moe.backends.transfer import Transfer

STAGING_BYTES = 256 << 20  # per staging buffer: enough to keep PCIe busy while a group computes


def reserve_bytes(cap: int) -> int:
    """Kept free for activations (a prefill chunk) and CUDA graphs after every pool is allocated."""
    return max(2 * GiB, cap // 20)


def device_memory(cfg: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(bytes the engine may still allocate on ``device`` now, the cap it plans for); CUDA only."""
    free, total = torch.cuda.mem_get_info(device)
    cap = min(total, cfg.max_gpu_memory_bytes or total)
    return int(cap * cfg.memory_ratio) - (total - free), cap


def device_budget(cfg: EngineConfig, device: torch.device) -> int:
    return device_memory(cfg, device)[0]


def moe_blocks(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "backend")]


@dataclass(frozen=True)
class MoePlan:
    backend: str
    layers: int = 0
    experts: int = 0  # per layer
    slots: int = 0  # cache slots per layer
    cache_bytes: int = 0  # this rank's slots and tables, all layers
    staging_bytes: int = 0
    host_bytes: int = 0  # this rank's host store
    pinned: bool = False
    policy: str = "lru"
    prefetch: bool = False


class MoeRuntime:
    def __init__(
        self, cfg: EngineConfig, mc: ModelConfig, tp: TPInfo, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cfg, self.mc, self.tp, self.device, self.dtype = cfg, mc, tp, device, dtype
        self.name = self._choose()
        self.offloads = self.name in OFFLOADING
        self.stores: list[HostStore] = []
        self.backends: list = []
        self.shared: Shared | None = None
        self.plan = MoePlan(self.name)

    @property
    def bank_device(self) -> torch.device | None:
        return torch.device("meta") if self.offloads else None

    def _choose(self) -> str:
        cfg, mc = self.cfg, self.mc
        if cfg.moe_backend != "auto":
            return cfg.moe_backend
        if "moe" not in mc.mlp_types or self.device.type != "cuda":
            return "gpu"
        from ft.models.info import footprint

        need = footprint(mc, self.tp.size, self.tp.rank, self.dtype).total_bytes
        budget = device_memory(cfg, self.device)[0]
        if need <= 0.9 * budget:
            return "gpu"
        if self.tp.is_first:
            print(
                f"ft: the model takes {need / GiB:.1f} GiB per rank, more than 90% of the "
                f"{budget / GiB:.1f} GiB GPU budget: experts offloaded (--moe-backend offload)",
                flush=True,
            )
        return "offload"

    # ---- before loading
    def attach_stores(self, model: torch.nn.Module) -> None:
        if not self.offloads:
            return
        blocks = moe_blocks(model)
        layouts = [ExpertLayout.of(b.experts) for b in blocks]
        per_rank = sum(lay.expert_bytes * b.experts.num_experts for lay, b in zip(layouts, blocks))
        check_host_memory(per_rank, local_ranks(self.tp.size), self.cfg.max_host_memory_bytes)
        pin = pin_available(self.device)
        for lay, b in zip(layouts, blocks):
            store = HostStore(lay, b.experts.num_experts, pin)
            store.adopt(b.experts)
            self.stores.append(store)

    @staticmethod
    def in_host_store(p: torch.Tensor) -> bool:
        return getattr(p, "in_host_store", False)

    # ---- after the pools
    def allocate(self, model: torch.nn.Module) -> MoePlan:
        blocks = moe_blocks(model)
        if not blocks:
            return self.plan
        e = blocks[0].experts.num_experts
        if not self.offloads:
            bank_bytes = sum(b.experts.weight_bytes() for b in blocks)
            self.plan = MoePlan("gpu", len(blocks), e, e, bank_bytes)
            return self.plan
        cfg, layout = self.cfg, self.stores[0].layout
        transfer = Transfer(self.device)
        staging = None
        slots = 0
        if self.name != "cpu":
            rows = cfg.moe_staging_experts or max(1, STAGING_BYTES // layout.expert_bytes)
            staging = Staging(layout, min(rows, e), self.device)
            slots = self._slots(layout, len(blocks), e, staging.nbytes)
        self.shared = Shared(transfer, staging, cfg.moe_prefill_hit_d2d, [])
        for i, (block, store) in enumerate(zip(blocks, self.stores)):
            if self.name == "cpu":
                backend = CpuBackend(store, self.shared, first=i == 0)
            else:
                cache = ExpertCache(layout, SlotMap(e, slots, cfg.expert_cache_policy), self.device)
                self.shared.maps.append(cache.map)
                cls = HybridBackend if self.name == "hybrid" else OffloadBackend
                backend = cls(store, cache, self.shared, first=i == 0)
            block.backend = backend
            self.backends.append(backend)
        if cfg.moe_prefetch and self.name != "cpu":
            for backend, nxt, block in zip(self.backends, self.backends[1:], blocks[1:]):
                backend.prefetch = Prefetch(block.gate, nxt)  # the next MoE layer's router
        caches = [b.cache for b in self.backends if b.cache is not None]
        self.plan = MoePlan(
            self.name,
            len(blocks),
            e,
            slots,
            sum(c.nbytes for c in caches),
            staging.nbytes if staging else 0,
            sum(s.nbytes for s in self.stores),
            self.stores[0].pinned,
            cfg.expert_cache_policy,
            cfg.moe_prefetch and self.name != "cpu",
        )
        return self.plan

    def _slots(self, layout: ExpertLayout, layers: int, e: int, staging_bytes: int) -> int:
        frac = self.cfg.expert_cache_fraction
        if frac is not None:
            return min(e, max(1, round(frac * e)))
        if self.device.type != "cuda":
            return e  # nothing to measure on a CPU-only machine: cache everything
        budget, cap = device_memory(self.cfg, self.device)
        left = budget - reserve_bytes(cap) - staging_bytes
        per_slot = layers * layout.expert_bytes
        slots = left // per_slot - 1  # each layer also holds its null row
        if slots < 1:
            raise MemoryError(
                f"no room for an expert cache: {left / GiB:.2f} GiB left on {self.device} after weights, "
                f"KV and state pools, {reserve_bytes(cap) / GiB:.1f} GiB reserve and "
                f"{staging_bytes / GiB:.2f} GiB staging, and one slot in each of {layers} layers takes "
                f"{2 * per_slot / GiB:.2f} GiB; lower --num-tokens or raise --memory-ratio / --max-gpu-memory"
            )
        return min(e, slots)

    # ---- CUDA graphs
    @property
    def splits_graphs(self) -> bool:
        """Decode graphs must break at each MoE layer (``graph_split``)."""
        return self.offloads and bool(self.backends)

    def max_graph_batch(self) -> int:
        """Largest decode batch a graph may hold: its experts must fit a layer's slots."""
        if not self.splits_graphs:
            return 1 << 30
        if self.name == "cpu":
            return 1 << 30
        if self.name == "hybrid":
            return HYBRID_MAX_TOKENS
        return self.plan.slots // self.mc.num_experts_per_tok

    # ---- reporting
    def describe(self, kv_tokens: int) -> str:
        p, gib = self.plan, GiB
        head = f"ft rank {self.tp.rank}/{self.tp.size}: moe {p.backend}"
        if not p.layers:
            return f"{head} (no MoE layers); KV {kv_tokens} tokens"
        if p.backend == "gpu":
            return (
                f"{head}: {p.layers} layers x {p.experts}/{p.experts} experts resident, "
                f"{p.cache_bytes / gib:.2f} GiB on {self.device}; KV {kv_tokens} tokens"
            )
        if p.backend == "cpu":
            return (
                f"{head}: {p.layers} layers x {p.experts} experts computed on the CPU from a host store of "
                f"{p.host_bytes / gib:.2f} GiB, none resident on {self.device}; KV {kv_tokens} tokens"
            )
        extra = f"{p.policy}, prefetch {'on' if p.prefetch else 'off'}"
        return (
            f"{head} ({extra}): {p.layers} layers x {p.slots}/{p.experts} experts resident "
            f"({p.slots / p.experts:.0%}), expert cache {p.cache_bytes / gib:.2f} GiB + staging "
            f"{p.staging_bytes / gib:.2f} GiB on {self.device}, host store {p.host_bytes / gib:.2f} GiB "
            f"{'pinned' if p.pinned else 'pageable'}; KV {kv_tokens} tokens"
        )

    def stats(self) -> dict:
        """This rank's counters (cumulative) for EngineStats, /metrics and ft bench."""
        p = self.plan
        out = {
            "moe_backend": p.backend,
            "moe_layers": p.layers,
            "moe_experts": p.experts,
            "moe_slots": p.slots,
        }
        sh = self.shared
        if sh is None:
            out["moe_resident"] = p.layers * p.experts if p.backend == "gpu" else 0
            return out
        sh.transfer.resolve()
        maps = [b.map for b in self.backends if b.map is not None]
        tc = sh.transfer.counts
        misses = sum(m.counts.misses for m in maps) + sum(
            getattr(b, "experts_seen", 0) for b in self.backends
        )
        out |= {
            "moe_resident": sum(m.num_resident for m in maps),
            "moe_hits": sum(m.counts.hits for m in maps),
            "moe_misses": misses,
            "moe_evictions": sum(m.counts.evictions for m in maps),
            "moe_prefetched": sum(m.counts.prefetched for m in maps),
            "moe_prefetch_hits": sum(m.counts.prefetch_hits for m in maps),
            "moe_bytes_h2d": tc.h2d_bytes,
            "moe_bytes_d2d": tc.d2d_bytes,
            "moe_copy_seconds": tc.copy_seconds,
            "moe_tokens": sh.tokens,
            "moe_cpu_pairs": sh.cpu_pairs,
        }
        return out
