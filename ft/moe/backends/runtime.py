"""MoeRuntime: the MoE backend of one rank, chosen once and set up around the model runner.

The runner calls it in this order:

    MoeRuntime(cfg, mc, tp, device, dtype)   picks the backend (auto: gpu if the model fits the
                                             GPU budget, else offload, and says so)
    build_model(..., bank_device=rt.bank_device)   offloading: banks built on meta
    rt.attach_stores(model, pool_bytes)      checks host memory, then allocates one host block
                                             per layer and places the banks' experts in it
                                             (``placement``), so loading fills it directly; a
                                             lean store's slots are sized and allocated here
    load weights / dummy weights; KV and state pools (planned before attach_stores)
    rt.allocate(model, max_running)          sizes the slot cache from what is left (or
                                             --expert-cache-fraction), allocates slots and
                                             staging, gives every MoE block its backend
    rt.describe(kv_tokens)                   the plan line each rank prints

How much memory each part takes is decided in ``sizing``. Lean store (``placement.py``): when
the host cannot hold every expert (or ``--static-experts R`` says so), R experts per layer live
in their cache slots only and the host stores the other E - R. The static experts are loaded
straight into their slots, so the caches must exist before loading: S is then decided and the
caches allocated in ``attach_stores``, the pools the runner planned (``pool_bytes``) subtracted
in advance, and ``allocate`` reuses them.

Not here: building the backends and filling their caches (``wiring``), what an idle engine
pre-stages (``prestage``), the plan, its line and the counters (``report``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ft.config import OFFLOAD_OPTIONS, EngineConfig
from ft.distributed import TPInfo
from ft.models.config import ModelConfig
from ft.moe.backends import (
    OFFLOADING,
    host_prefetch,
    host_reads,
    host_stage,
    prestage,
    sizing,
    staging,
    wiring,
)
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.host_store import (
    GiB,
    HostStore,
    check_host_memory,
    host_experts,
    local_ranks,
    pin_available,
)
from ft.moe.backends.hybrid import HYBRID_MAX_TOKENS
from ft.moe.backends.layout import ExpertLayout
from ft.moe.backends.placement import place
from ft.moe.backends.report import MoePlan, counters, describe
from ft.moe.backends.slot_map import SlotMap
from ft.moe.backends.staging import Shared, Staging
from ft.moe.backends.transfer import Transfer


def moe_blocks(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "backend")]


class MoeRuntime:
    def __init__(
        self, cfg: EngineConfig, mc: ModelConfig, tp: TPInfo, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cfg, self.mc, self.tp, self.device, self.dtype = cfg, mc, tp, device, dtype
        self.name = self._choose()
        self.offloads = self.name in OFFLOADING
        self.streams = self.offloads and self.name != "cpu"  # experts streamed through staging
        self.stores: list[HostStore] = []
        self.caches: list[ExpertCache] = []  # a lean store's, allocated before loading
        self.static = 0  # experts per layer on the GPU only (lean store)
        self.backends: list = []
        self.shared: Shared | None = None
        self.reads: host_reads.HostReads | None = None  # decode reading the host store in place
        self.bank = None  # the first MoE layer's bank (what a decode batch takes: ``runs_unattended``)
        self.plan = MoePlan(self.name)

    @property
    def bank_device(self) -> torch.device | None:
        return torch.device("meta") if self.offloads else None

    def _choose(self) -> str:
        cfg, mc = self.cfg, self.mc
        if cfg.moe_backend != "auto":
            return cfg.moe_backend
        if "moe" not in mc.mlp_types:
            return "gpu"
        given = [n for n in OFFLOAD_OPTIONS if getattr(cfg, n) is not None]
        if given:  # an expert cache asked for by size: offload, as the option means
            if self.tp.is_first:
                print(f"ft: --{given[0].replace('_', '-')} given: experts offloaded (--moe-backend offload)")
            return "offload"
        if self.device.type != "cuda":
            return "gpu"
        from ft.models.info import footprint

        need = footprint(mc, self.tp.size, self.tp.rank, self.dtype).total_bytes
        budget = sizing.device_budget(cfg, self.device)
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
    def attach_stores(self, model: torch.nn.Module, pool_bytes: int = 0) -> None:
        """Allocate the host stores (and a lean store's caches) and place the banks' experts in
        them, before anything is loaded. ``pool_bytes``: the KV and state pools to come."""
        blocks = moe_blocks(model)
        if not self.offloads or not blocks:
            return
        self.bank = blocks[0].experts
        layouts = [ExpertLayout.of(b.experts) for b in blocks]
        e = blocks[0].experts.num_experts
        per_expert = sum(lay.expert_bytes for lay in layouts)  # one expert of every layer
        ranks, limit = local_ranks(self.tp.size), self.cfg.max_host_memory_bytes
        self.static = sizing.static_experts(self.cfg, self.name, e, host_experts(per_expert, ranks, limit))
        hint = "; the cpu backend needs them all on the host (offload and hybrid do not)"
        check_host_memory((e - self.static) * per_expert, ranks, limit, hint if self.name == "cpu" else "")
        if self.static:
            staged = sizing.staging_bytes(self.cfg, layouts[0], e)
            slots = self._slots(layouts[0], len(blocks), e, staged, pool_bytes)
        pin = pin_available(self.device)
        for lay, b in zip(layouts, blocks):
            store = HostStore(lay, e, pin, self.static)
            cache = None
            if self.static:
                slot_map = SlotMap(e, slots, self.cfg.expert_cache_policy, self.static)
                cache = ExpertCache(lay, slot_map, self.device, self._spare_rows())
                self.caches.append(cache)
            place(b.experts, store, cache)
            self.stores.append(store)

    # ---- after the pools
    def allocate(self, model: torch.nn.Module, max_running: int) -> MoePlan:
        blocks = moe_blocks(model)
        if not blocks:
            return self.plan
        e = blocks[0].experts.num_experts
        self.bank = blocks[0].experts
        if not self.offloads:
            bank_bytes = sum(b.experts.weight_bytes() for b in blocks)
            self.plan = MoePlan("gpu", len(blocks), e, e, cache_bytes=bank_bytes)
            return self.plan
        cfg, layout = self.cfg, self.stores[0].layout
        buffers = None
        if self.name != "cpu":
            buffers = Staging(
                layout, sizing.staging_rows(cfg, layout, e), self.device, sizing.STAGING_BUFFERS
            )
            if not self.caches:  # a lean store's were allocated before loading
                slots = self._slots(layout, len(blocks), e, buffers.nbytes)
                policy = cfg.expert_cache_policy
                spare = self._spare_rows()
                self.caches = [
                    ExpertCache(layout, SlotMap(e, slots, policy), self.device, spare) for _ in blocks
                ]
        maps = [c.map for c in self.caches]
        self.shared = Shared(
            Transfer(self.device), buffers, cfg.moe_prefill_hit_d2d, maps, cfg.moe_stream_ahead
        )
        self.shared.activation_per_token = sizing.activation_bytes_per_token(self.mc, self.dtype.itemsize)
        self.shared.prestage_room = staging.PRESTAGE_CPU_BYTES  # on a GPU measured when idle
        prefetch = cfg.moe_prefetch and self.name != "cpu"
        self.backends = wiring.build(self.name, blocks, self.stores, self.caches, self.shared, prefetch)
        if self.name == "offload" and (self.stores[0].pinned or self.device.type == "cpu"):
            k, stage_tokens = self.mc.num_experts_per_tok, self._stage_tokens()
            self.reads = host_reads.HostReads(self.backends, k, self.device, self.bank.format, stage_tokens)
        unattended = [n for n in range(1, max_running + 1) if self.runs_unattended(n)]
        self.plan = MoePlan(
            self.name,
            len(blocks),
            e,
            slots=self.caches[0].map.num_slots if self.caches else 0,
            static=self.static,
            cache_bytes=sum(c.nbytes for c in self.caches),
            staging_bytes=buffers.nbytes if buffers else 0,
            host_bytes=sum(s.nbytes for s in self.stores),
            pinned=self.stores[0].pinned,
            policy=cfg.expert_cache_policy,
            prefetch=prefetch,
            unattended_tokens=max(unattended, default=0),
        )
        return self.plan

    def runs_unattended(self, tokens: int) -> bool:
        """Whether a decode batch of ``tokens`` tokens runs without the host mid-step: its experts
        all on the device, or the missed ones read in place (host reads), rather than copied in
        by layers that read their routing back or computed by the CPU. Only then does a step
        issued ahead (``LLMEngine.step``) overlap the host's work: otherwise the host waits inside
        it, and the tokens of the step before come out a step late."""
        return not self.backends or self._reads_take(tokens)

    def _reads_take(self, tokens: int) -> bool:
        """Whether host reads take a decode batch of ``tokens`` tokens: on, and a size the kernel
        that reads the host store takes."""
        if self.reads is None or not host_reads.ENABLED:
            return False
        return self.reads.takes_tokens(self.bank, tokens, self.device.type == "cuda")

    def _spare_rows(self) -> int:
        """Rows per layer past the null slot for host reads' prefetch: the offload backend, with
        prefetch, where kernels can read the host store (pinned memory, or a CPU); as many as the
        bank's format asks (``host_prefetch.rows``)."""
        reads = self.device.type == "cpu" or pin_available(self.device)
        on = self.name == "offload" and self.cfg.moe_prefetch and reads
        return host_prefetch.rows(self.bank.format if self.bank is not None else None) if on else 0

    def _stage_tokens(self) -> int:
        """The largest decode batch host reads take, whose pairs host staging's block holds
        (``host_stage.stages``, offload backend); 0 without it."""
        if not (self.name == "offload" and self.bank is not None and host_stage.stages(self.bank.format)):
            return 0
        return host_reads.HostReads.max_tokens(self.bank, self.device.type == "cuda")

    def _slots(self, layout: ExpertLayout, layers: int, e: int, staged: int, pools: int = 0) -> int:
        k = self.mc.num_experts_per_tok
        staged += layers * self._spare_rows() * layout.expert_bytes  # held beside the slots
        staged += self._stage_tokens() * k * layout.expert_bytes  # host staging's block
        return sizing.cache_slots(self.cfg, self.device, layout, layers, e, k, staged, pools, self.static)

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
        return (self.plan.slots - self.plan.static) // self.mc.num_experts_per_tok

    # ---- between steps
    def before_step(self, tokens: int) -> None:
        """Before each forward (``tokens``: its batch's): pre-staged layers that would crowd its
        activations are dropped (``Shared.fit_prestaged``); a batch that host reads may take
        gets every layer's routes as the maps now stand (``HostReads.before_step``)."""
        if self.shared is not None and self.shared.prestaged:
            self.shared.fit_prestaged(tokens)
        if self._reads_take(tokens):
            self.reads.before_step()

    def idle(self) -> None:
        """The engine has nothing to run: with ``staging.PRESTAGE``, copy MoE layers' host-only
        experts into buffers of their own (``prestage.idle``)."""
        sh = self.shared
        if not staging.PRESTAGE or sh is None or sh.staging is None or self.name == "cpu":
            return
        prestage.idle(self.cfg, self.device, sh, self.backends)

    def after_step(self, tokens: int) -> None:
        """After each forward (``tokens``: its batch's real tokens, which the statistics count
        here: a graphed batch's MoE layers see the rows that pad it too): host reads' counting and
        promotions (their routes are published before the next batch that reads them,
        ``before_step``)."""
        if self.shared is not None:
            self.shared.tokens += tokens
        if self.reads is not None:
            self.reads.after_step()

    def flush(self) -> None:
        """Count the step deferred host reads still hold (the engine calls it when idle, so the
        statistics include every step run; ``HostReads.flush``)."""
        if self.reads is not None:
            self.reads.flush()

    def discard_uses(self) -> None:
        """Forget what warming up and capturing the decode graphs used and counted (their forwards
        on padding rows copy, evict and count uses on the copying, hybrid and cpu paths): the
        statistics count requests' traffic only, as they leave out the start-up fill
        (``wiring.build``)."""
        if self.reads is not None:
            self.reads.discard()
        if self.shared is not None:
            self.shared.reset_counts()
        for backend in self.backends:
            if hasattr(backend, "experts_seen"):  # the cpu backend's misses
                backend.experts_seen = 0

    def restart_caches(self) -> None:
        """Every expert cache back to its start-up fill (``SlotMap.restart``), copied in now, so
        that each variant ``ft bench offline`` measures on one loaded model starts from the same
        contents instead of the previous variant's (``wiring.restart``)."""
        if self.caches:
            wiring.restart(self.backends, self.caches, self.shared, self.reads, self.device)

    def set_policy(self, policy: str) -> None:
        for cache in self.caches:
            cache.map.set_policy(policy)
        self.plan = replace(self.plan, policy=policy)

    # ---- reporting
    def describe(self, kv_tokens: int, state_rows: int = 0, state_bytes: int = 0) -> str:
        """The plan line this rank prints (``report.describe``)."""
        return describe(self.plan, self.tp, self.device, kv_tokens, state_rows, state_bytes)

    def stats(self) -> dict:
        """This rank's counters (cumulative) for EngineStats, /metrics and ft bench."""
        return counters(self.plan, self.shared, self.backends, self.reads)
