"""What the MoE runtime of one rank reports: its plan (``MoePlan``, decided at start-up), the plan
line the rank prints (``describe``) and its cumulative counters (``counters``: EngineStats,
/metrics and ``ft bench`` read them).

Not here: how the plan is decided (``runtime``, ``sizing``), what keeps the counts (the slot maps,
``Transfer``, ``Shared``, ``HostReads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ft.distributed import TPInfo
from ft.moe.backends.host_store import GiB

if TYPE_CHECKING:
    from ft.moe.backends.host_reads import HostReads
    from ft.moe.backends.staging import Shared


@dataclass(frozen=True)
class MoePlan:
    backend: str
    layers: int = 0
    experts: int = 0  # per layer
    slots: int = 0  # cache slots per layer
    static: int = 0  # of which hold an expert with no host copy, for the whole run (lean store)
    cache_bytes: int = 0  # this rank's slots and tables, all layers
    staging_bytes: int = 0
    host_bytes: int = 0  # this rank's host store
    pinned: bool = False
    policy: str = "lru"
    prefetch: bool = False
    # the largest decode batch (tokens) that runs without the host mid-step, None: any
    # (``MoeRuntime.runs_unattended``, as the switches stood at start-up)
    unattended_tokens: int | None = None


def describe(
    p: MoePlan, tp: TPInfo, device: torch.device, kv_tokens: int, state_rows: int = 0, state_bytes: int = 0
) -> str:
    """The plan line: experts resident and where, the store, the KV pool and, for GDN models,
    the state pool (one row a request slot and a prefix snapshot: ``--max-running-requests``
    sizes both, and what they hold the expert cache does not get)."""
    head = f"ft rank {tp.rank}/{tp.size}: moe {p.backend}"
    pools = f"KV {kv_tokens} tokens"
    if state_rows:
        pools += f"; GDN states {state_bytes / GiB:.2f} GiB in {state_rows} rows"
    if not p.layers:
        return f"{head} (no MoE layers); {pools}"
    if p.backend == "gpu":
        return (
            f"{head}: {p.layers} layers x {p.experts}/{p.experts} experts resident, "
            f"{p.cache_bytes / GiB:.2f} GiB on {device}; {pools}"
        )
    if p.backend == "cpu":
        return (
            f"{head}: {p.layers} layers x {p.experts} experts computed on the CPU from a host store of "
            f"{p.host_bytes / GiB:.2f} GiB, none resident on {device}; {pools}"
        )
    extra = f"{p.policy}, prefetch {'on' if p.prefetch else 'off'}"
    lean = f"; {p.static} static + {p.slots - p.static} dynamic slots" if p.static else ""
    held = f" of {p.experts - p.static} experts a layer" if p.static else ""
    return (
        f"{head} ({extra}): {p.layers} layers x {p.slots}/{p.experts} experts resident "
        f"({p.slots / p.experts:.0%}{lean}), expert cache {p.cache_bytes / GiB:.2f} GiB + staging "
        f"{p.staging_bytes / GiB:.2f} GiB on {device}, host store {p.host_bytes / GiB:.2f} GiB"
        f"{held} {'pinned' if p.pinned else 'pageable'}; {pools}"
    )


def counters(p: MoePlan, sh: Shared | None, backends: list, reads: HostReads | None) -> dict:
    """The rank's counters (cumulative): ``sh``, ``backends`` and ``reads`` the runtime's, None
    and empty when the experts are resident."""
    out = {
        "moe_backend": p.backend,
        "moe_layers": p.layers,
        "moe_experts": p.experts,
        "moe_slots": p.slots,
    }
    if sh is None:
        out["moe_resident"] = p.layers * p.experts if p.backend == "gpu" else 0
        return out
    sh.transfer.resolve()
    if sh.prestage_transfer is not None:  # its copy time into the same counts
        sh.prestage_transfer.resolve()
    maps = [b.map for b in backends if b.map is not None]
    tc = sh.transfer.counts
    misses = sum(m.counts.misses for m in maps) + sum(getattr(b, "experts_seen", 0) for b in backends)
    out |= {
        "moe_resident": sum(m.num_resident for m in maps),
        "moe_hits": sum(m.counts.hits for m in maps),
        "moe_misses": misses,
        "moe_evictions": sum(m.counts.evictions for m in maps),
        "moe_prefetched": sum(m.counts.prefetched for m in maps),
        "moe_prefetch_hits": sum(m.counts.prefetch_hits for m in maps),
        "moe_bytes_h2d": tc.h2d_bytes,
        "moe_bytes_host_read": reads.bytes_read if reads is not None else 0,
        "moe_bytes_d2d": tc.d2d_bytes,
        "moe_copy_seconds": tc.copy_seconds,
        "moe_tokens": sh.tokens,
        "moe_cpu_pairs": sh.cpu_pairs,
        "moe_prestaged_layers": sh.prestage_used,
    }
    return out
