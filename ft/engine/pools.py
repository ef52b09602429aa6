"""A rank's KV pool and GDN state pool: how large (``plan_pools``, decided once, before the
experts are placed and loaded, so that an offloaded model's expert cache gets what they leave)
and their tensors on the layers that own them (``allocate_pools``).

KV: ``[2, blocks, block_size, kv_heads, head_dim]`` per attention layer (and any per-token cache
beside it, ``extra_paged_caches``). Without ``--num-tokens`` it is 90% of the budget on a GPU, or
one full context when the experts are offloaded; 64k tokens on a CPU. GDN state: per layer a
conv and a recurrent state row per running request, one scratch row for padded CUDA-graph rows,
then the prefix cache's snapshots. Not here: the block bookkeeping (``ft.scheduler.kv_pool``), the
expert cache (``ft.moe.backends.sizing``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ft.config import EngineConfig
from ft.distributed import TPInfo, min_over_ranks
from ft.moe.backends.report import MoePlan
from ft.moe.backends.sizing import DEFAULT_RUNNING, default_running, device_budget, device_cap, prefill_chunk


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    num_slots: int
    weight_bytes: int
    kv_bytes: int
    state_bytes: int
    num_snapshots: int = 0  # GDN state snapshots for the prefix cache
    has_gdn: bool = False
    moe: MoePlan | None = None
    prefill_chunk: int = 8192  # tokens a prefill chunk takes (``sizing.prefill_chunk``)

    @property
    def state_rows(self) -> int:
        """GDN state rows: one a request slot, the scratch slot, then one a prefix snapshot."""
        return self.num_slots + 1 + self.num_snapshots


@dataclass(frozen=True)
class CacheLayers:
    """The model's layers that own caches: attention (``cache_shape``), GDN (``state_shapes``)."""

    attention: list
    gdn: list

    @classmethod
    def of(cls, model: torch.nn.Module) -> CacheLayers:
        modules = list(model.modules())
        return cls(
            [m for m in modules if hasattr(m, "cache_shape")],
            [m for m in modules if hasattr(m, "state_shapes")],
        )


def kv_bytes_per_token(layers: CacheLayers, dtype: torch.dtype) -> int:
    size, total = torch.tensor([], dtype=dtype).element_size(), 0
    for m in layers.attention:
        h, d = m.cache_shape()
        total += 2 * h * d * size
        for shape in getattr(m, "extra_paged_caches", dict)().values():
            total += math.prod(shape) * size
    return total


def state_row_bytes(layers: CacheLayers, dtype: torch.dtype) -> int:
    """One GDN state row over every GDN layer: its conv state (model dtype) and recurrent (fp32)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(
        math.prod(conv) * size + math.prod(ssm) * 4 for conv, ssm in (m.state_shapes() for m in layers.gdn)
    )


def pool_tokens(cfg: EngineConfig, mc, device: torch.device, offloads: bool, per_token: int) -> int:
    if cfg.num_tokens is not None:
        return cfg.num_tokens
    if device.type != "cuda":
        return 64 * 1024
    tokens = max(cfg.block_size, int(device_budget(cfg, device) * 0.9) // max(1, per_token))
    if offloads:  # the expert cache gets the rest: one full context by default
        tokens = min(tokens, cfg.model_len(mc.max_position_embeddings))
    return tokens


def max_running(cfg: EngineConfig, device: torch.device, streams: bool, row: int, say: bool) -> int:
    """``--max-running-requests``, or its default (``sizing.default_running``) for GDN state rows
    of ``row`` bytes (0: none), said (``say``) when it is below the usual."""
    if cfg.max_running_requests is not None:
        return cfg.max_running_requests
    cap = device_cap(cfg, device) if device.type == "cuda" and streams else None
    snapshots = bool(row) and cfg.enable_prefix_cache
    follow = snapshots and cfg.prefix_snapshot_slots is None  # a snapshot a request
    fixed = 1 + ((cfg.prefix_snapshot_slots or 0) if snapshots else 0)  # the scratch row, given snapshots
    running = default_running(cap, row, fixed, 2 if follow else 1)
    if running < DEFAULT_RUNNING and say:
        print(
            f"ft: at most {running} running requests (the experts stream, and each request's GDN "
            f"state, {row / 2**20:,.0f} MiB, comes out of their cache; --max-running-requests N)",
            flush=True,
        )
    return running


def plan_pools(cfg: EngineConfig, mc, layers: CacheLayers, device, dtype, moe, tp: TPInfo) -> PoolPlan:
    """The pools' sizes for a rank whose MoE runtime is ``moe`` (weights not counted yet), the
    same on every rank: each takes the least any rank can hold (its budget is what its own GPU
    has left), since the scheduler hands every rank the same block and slot ids."""
    per_token = kv_bytes_per_token(layers, dtype)
    num_blocks = max(1, pool_tokens(cfg, mc, device, moe.offloads, per_token) // cfg.block_size)
    row = state_row_bytes(layers, dtype)
    running = max_running(cfg, device, moe.streams, row, tp.is_first)
    num_blocks, running = min_over_ranks([num_blocks, running], tp, device)
    snaps = (cfg.prefix_snapshot_slots or running) if layers.gdn and cfg.enable_prefix_cache else 0
    state_bytes = (running + 1 + snaps) * row  # a slot a request, the scratch slot, the snapshots
    kv_bytes = num_blocks * cfg.block_size * per_token
    chunk = prefill_chunk(cfg, mc, device, moe.streams)
    return PoolPlan(num_blocks, running, 0, kv_bytes, state_bytes, snaps, bool(layers.gdn), None, chunk)


def allocate_pools(
    plan: PoolPlan, cfg: EngineConfig, layers: CacheLayers, device, dtype
) -> list[torch.Tensor]:
    """The planned KV and state tensors, on the layers that own them. Returns the GDN state
    stacks: the layers' conv and recurrent states of one shape are views of one tensor
    ``[layers, rows, ...]``, so a step's snapshot copies are one gather and one scatter a stack
    (``ModelRunner._copy_states``), not two a layer."""
    bs, rows = cfg.block_size, plan.state_rows
    for m in layers.attention:
        h, d = m.cache_shape()
        m.kv_cache = torch.zeros(2, plan.num_blocks, bs, h, d, dtype=dtype, device=device)
        # per-token caches beside k/v (e.g. an indexer's keys), paged like them: [blocks, bs, *shape]
        for name, shape in getattr(m, "extra_paged_caches", dict)().items():
            setattr(m, name, torch.zeros(plan.num_blocks, bs, *shape, dtype=dtype, device=device))
    groups: dict[tuple, list] = {}  # (conv shape, ssm shape) -> its layers
    for m in layers.gdn:
        conv, ssm = m.state_shapes()
        groups.setdefault((tuple(conv), tuple(ssm)), []).append(m)
    stacks = []
    for (conv, ssm), members in groups.items():
        convs = torch.zeros(len(members), rows, *conv, dtype=dtype, device=device)
        ssms = torch.zeros(len(members), rows, *ssm, dtype=torch.float32, device=device)
        for i, m in enumerate(members):
            m.conv_state, m.ssm_state = convs[i], ssms[i]
        stacks += [convs, ssms]
    return stacks
