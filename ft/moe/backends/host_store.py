"""The host store: this rank's routed experts of one MoE layer in (pinned) host memory.

Each layer gets one block, ``[E, expert_bytes]`` uint8 in the bank's expert-major layout
(``layout.py``), page-locked whole with cudaHostRegister when the model runs on a GPU (ordinary
memory on a CPU-only machine, where pinning needs CUDA). The bank's expert parameters are then
replaced by views of the block (``adopt``), so the bank's own weight loaders, and dummy
initialisation, write straight into host memory: no second copy of the experts is ever held and
the device never sees them whole. Before anything is allocated, ``check_host_memory`` refuses a
plan that does not fit, with the figures.

A rank stores only its tensor-parallel shard (I/P of every expert). Not here: which experts are
on the device (``expert_cache``), moving them (``transfer``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ft.moe.backends.layout import ExpertLayout, pin_in_place

GiB = 1 << 30


class HostStore:
    def __init__(self, layout: ExpertLayout, num_experts: int, pin: bool) -> None:
        self.layout, self.num_experts, self.pinned = layout, num_experts, False
        self.block = layout.allocate(num_experts, "cpu", zero=False)  # [E, expert_bytes]
        if pin:
            try:
                pin_in_place(self.block)
                self.pinned = True
            except RuntimeError as e:  # still correct, but copies run at pageable speed (~21 GB/s)
                print(f"ft: the expert host store stays pageable: {e}", flush=True)
        self.tensors = layout.views(self.block)  # name -> [E, *shape]

    @property
    def nbytes(self) -> int:
        return self.block.numel()

    def adopt(self, bank: nn.Module) -> None:
        """Make ``bank``'s expert parameters views of this store, keeping their loaders and marks."""
        for name, view in self.tensors.items():
            old = getattr(bank, name)
            assert tuple(old.shape) == tuple(view.shape) and old.dtype == view.dtype, (
                f"bank {name} {tuple(old.shape)} {old.dtype} does not match its host view "
                f"{tuple(view.shape)} {view.dtype}"
            )
            new = nn.Parameter(view, requires_grad=False)
            new.__dict__.update(old.__dict__)  # weight_loader, checkpoint_parts, logical_numel
            new.in_host_store = True
            setattr(bank, name, new)


def host_memory_limit() -> int:
    """This host's memory in bytes as the kernel reports it (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(per_rank: int, ranks_on_host: int, limit: int | None = None) -> None:
    """Refuse a host store that the host cannot hold, before anything is allocated or read."""
    stated = limit is not None
    limit = limit if stated else host_memory_limit()
    need = per_rank * ranks_on_host
    headroom = min(8 * GiB, limit // 10)  # the processes themselves, the page cache of the checkpoint
    if need + headroom > limit:
        source = "--max-host-memory" if stated else "MemTotal"
        raise MemoryError(
            f"the offloaded experts need {need / GiB:.2f} GiB of host memory ({per_rank / GiB:.2f} GiB "
            f"on each of {ranks_on_host} rank(s) on this host) plus {headroom / GiB:.1f} GiB headroom, "
            f"but this host has {limit / GiB:.2f} GiB ({source}). Use more tensor-parallel ranks "
            "(each stores I/P of every expert), NVFP4 experts (--quantize-experts nvfp4), or, where "
            "MemTotal under-reports the machine, state it with --max-host-memory"
        )


def local_ranks(tp_size: int) -> int:
    """Ranks sharing this host: torchrun's LOCAL_WORLD_SIZE, else all of them (``ft`` spawns locally)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))


def pin_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()
