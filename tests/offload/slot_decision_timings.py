"""The copying decode path's slot decisions for one layer, on this machine's CPU (not a test):

    python tests/offload/slot_decision_timings.py [EXPERTS] [SLOTS] [TOKENS] [TOP_K]

Defaults: Qwen3-Next-80B's 512 experts a layer, 404 slots (NVFP4 under 48 GiB), a batch of 8
tokens, top-10. Each step draws the batch's experts at random (uniform routing) and a guess
that holds half of them, then times ``SlotMap.ensure`` (the misses into slots) and
``SlotMap.prefetch`` (the guess into slots) as a layer of a copying decode step runs them on
the host, for LRU and LFU in turn; prints the mean of 300 steps, twice each. A 48-layer step
runs both once a layer."""

from __future__ import annotations

import sys
import time

import numpy as np

from ft.moe.backends.slot_map import SlotMap


def run(policy: str, experts: int, slots: int, tokens: int, k: int, steps: int = 300) -> str:
    rng = np.random.default_rng(0)
    m = SlotMap(num_experts=experts, num_slots=slots, policy=policy)
    m.warm()
    spent = {"ensure": 0.0, "prefetch": 0.0}
    for step in range(steps):
        m.begin_step(step)
        used = np.unique(rng.integers(0, experts, tokens * k))
        guess = np.unique(np.concatenate([used[: len(used) // 2], rng.integers(0, experts, tokens * k // 2)]))
        t0 = time.perf_counter()
        m.ensure(used)
        t1 = time.perf_counter()
        m.prefetch(guess)
        spent["ensure"] += t1 - t0
        spent["prefetch"] += time.perf_counter() - t1
    return f"{policy}: " + ", ".join(f"{name} {s / steps * 1e6:.1f} us" for name, s in spent.items())


def main() -> None:
    defaults = ["512", "404", "8", "10"]
    experts, slots, tokens, k = (int(a) for a in sys.argv[1:] + defaults[len(sys.argv) - 1 :])
    for policy in ("lru", "lfu", "lru", "lfu"):
        print(run(policy, experts, slots, tokens, k))


if __name__ == "__main__":
    main()
