"""Host reads' between-step host work for a model's shape, on this machine's CPU (not a test):

    python tests/offload/host_work_timings.py [LAYERS] [EXPERTS] [SLOTS] [TOP_K] [TOKENS]

Defaults: Qwen3-Next-80B's 48 layers of 512 experts, 404 resident (NVFP4 under 48 GiB), top-10,
batch 1. Each step draws every layer's experts at random (uniform routing), then times
``HostReads._count_and_promote`` (hits and misses counted, promotions chosen and issued) and
``Tables.publish`` (every layer's tables) as the engine runs them between two steps; prints the
median of 300 steps after 50 of warm-up. The "device" is the CPU, so copies are plain memcpys
of a small stand-in row: what is timed is the bookkeeping, which on a GPU machine runs on its
host the same way (there CUDA events and the pinned copies add to it)."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from ft.moe.backends import host_reads
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.host_store import HostStore
from ft.moe.backends.layout import ExpertLayout, Part
from ft.moe.backends.offload import OffloadBackend
from ft.moe.backends.slot_map import SlotMap
from ft.moe.backends.staging import Shared
from ft.moe.backends.transfer import Transfer


def main() -> None:
    defaults = ["48", "512", "404", "10", "1"]
    layers, experts, slots, k, tokens = (int(a) for a in sys.argv[1:] + defaults[len(sys.argv) - 1 :])
    cpu = torch.device("cpu")
    layout = ExpertLayout((Part("w", (4,), torch.float32, 0),), 256)  # a stand-in row
    maps = [SlotMap(experts, slots) for _ in range(layers)]
    shared = Shared(Transfer(cpu), None, False, maps)
    backends = []
    for i, m in enumerate(maps):
        m.begin_step(0)
        m.warm()
        backends.append(
            OffloadBackend(HostStore(layout, experts, pin=False), ExpertCache(layout, m, cpu), shared, i == 0)
        )
    reads = host_reads.HostReads(backends, k, cpu)
    rng = np.random.default_rng(0)

    def step() -> tuple[float, float]:
        uses = np.zeros((layers, experts), dtype=np.int32)
        for i in range(layers):
            for _ in range(tokens):
                uses[i, rng.choice(experts, k, replace=False)] += 1
        routes = [b.cache.published() for b in backends]
        t0 = time.perf_counter()
        reads._count_and_promote(uses, routes)
        t1 = time.perf_counter()
        reads.tables.publish()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(50):
        step()
    times = np.array([step() for _ in range(300)])
    count, publish = 1e3 * np.median(times, axis=0)
    print(f"{layers} layers x {slots}/{experts} experts, top-{k}, {tokens} token(s): "
          f"_count_and_promote {count:.3f} ms, Tables.publish {publish:.3f} ms a step")  # fmt: skip


if __name__ == "__main__":
    main()
