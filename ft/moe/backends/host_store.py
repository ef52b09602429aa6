"""The host store: this rank's routed experts of one MoE layer in (pinned) host memory.

Each layer gets one block, ``[n, expert_bytes]`` uint8 in the bank's expert-major layout
(``layout.py``), page-locked whole with cudaHostRegister when the model runs on a GPU (ordinary
memory on a CPU-only machine, where pinning needs CUDA). Normally it holds every expert (n = E);
a lean store (``placement.py``) holds only experts [R, E), in rows e - R, the first R living on
the device alone. The bank's loaders and dummy initialisation write into the block directly
(``placement.place``): no second copy of the experts is ever held. Before anything is allocated,
``check_host_memory`` refuses a plan that does not fit, with the figures, and ``host_experts``
says how many experts per layer a host can hold under the same rule.

A rank stores only its tensor-parallel shard (I/P of every expert). Not here: which experts are
on the device (``expert_cache``), moving them (``transfer``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ft.moe.backends.layout import ExpertLayout, pin_in_place

GiB = 1 << 30


class HostStore:
    def __init__(self, layout: ExpertLayout, num_experts: int, pin: bool, static: int = 0) -> None:
        self.layout, self.num_experts, self.static, self.pinned = layout, num_experts, static, False
        self.block = layout.allocate(num_experts - static, "cpu", zero=False)  # [E - R, expert_bytes]
        if pin:
            try:
                pin_in_place(self.block)
                self.pinned = True
            except RuntimeError as e:  # still correct, but copies run at pageable speed (~21 GB/s)
                print(f"ft: the expert host store stays pageable: {e}", flush=True)
        self.tensors = layout.views(self.block)  # name -> [E - R, *shape]

    @property
    def nbytes(self) -> int:
        return self.block.numel()

    def rows(self, experts: np.ndarray) -> np.ndarray:
        """The block rows of ``experts``; a static expert has none (it lives on the device only)."""
        rows = np.asarray(experts, dtype=np.int64) - self.static
        assert not (rows < 0).any(), f"experts {np.asarray(experts)[rows < 0]} are static: no host copy"
        return rows


def host_memory_limit() -> int:
    """This host's memory in bytes as the kernel reports it (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def headroom_bytes(limit: int) -> int:
    """Host memory kept free beside the stores: the processes themselves, the checkpoint's page cache."""
    return min(8 * GiB, limit // 10)


def host_experts(per_expert: int, ranks_on_host: int, limit: int | None = None) -> int:
    """How many experts per layer this host can store, ``per_expert`` bytes being one expert of
    every layer on one rank (the rule of ``check_host_memory``)."""
    limit = limit if limit is not None else host_memory_limit()
    return max(0, limit - headroom_bytes(limit)) // max(1, per_expert * ranks_on_host)


def check_host_memory(per_rank: int, ranks_on_host: int, limit: int | None = None, hint: str = "") -> None:
    """Refuse a host store that the host cannot hold, before anything is allocated or read."""
    stated = limit is not None
    limit = limit if stated else host_memory_limit()
    need = per_rank * ranks_on_host
    headroom = headroom_bytes(limit)
    if need + headroom > limit:
        source = "--max-host-memory" if stated else "MemTotal"
        raise MemoryError(
            f"the offloaded experts need {need / GiB:.2f} GiB of host memory ({per_rank / GiB:.2f} GiB "
            f"on each of {ranks_on_host} rank(s) on this host) plus {headroom / GiB:.1f} GiB headroom, "
            f"but this host has {limit / GiB:.2f} GiB ({source}). Use more tensor-parallel ranks "
            "(each stores I/P of every expert), NVFP4 experts (--quantize-experts nvfp4), or, where "
            f"MemTotal under-reports the machine, state it with --max-host-memory{hint}"
        )


def local_ranks(tp_size: int) -> int:
    """Ranks sharing this host: torchrun's LOCAL_WORLD_SIZE, else all of them (``ft`` spawns locally)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))


def pin_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()
