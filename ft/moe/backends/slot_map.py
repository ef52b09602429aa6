"""The host half of a layer's GPU expert cache: which expert each of S slots holds, what to evict,
and the hit / miss counts (numpy; it decides and never touches a device tensor, so it is
unit-tested on its own). ``StackedMaps`` keeps every layer's maps as rows of shared arrays, for
host reads to count a step of every layer at once.

Static slots (a lean host store, ``placement.py``): slots [0, R) hold experts [0, R) for the whole
run. They are resident from the start (so every use is a hit), never a victim of ``ensure`` or
``prefetch``, and the other S - R *dynamic* slots cache the rest as below.

Pinning: ``ensure`` pins the experts a batch uses for the current step (``begin_step``); nothing
evicts a pinned slot until the next step, so a prefetch for this layer issued mid-step can never
overwrite an expert the step is about to read. Policies (lower score is evicted first):

- ``lru``: least recently used.
- ``lfu``: frequency-aware, the lowest exponentially decayed use count (half-life
  ``LFU_HALF_LIFE`` calls), ties broken by recency. Under skewed routing it keeps the popular
  experts through bursts of rare ones that would flush an LRU cache.

Not here: the slots themselves and the device-side table (``expert_cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ft.config import CACHE_POLICIES as POLICIES

LFU_HALF_LIFE = 64.0  # calls of ensure/prefetch on the layer


def unique(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """The distinct experts of ``ids``, ascending (a count, not a sort: a prefill chunk has
    T·k ids of at most E values)."""
    return np.flatnonzero(np.bincount(ids.reshape(-1), minlength=num_experts))


@dataclass
class SlotCounts:
    hits: int = 0  # experts a batch needed that were resident
    misses: int = 0  # experts a batch needed that were not
    evictions: int = 0
    prefetched: int = 0  # experts inserted ahead of need
    prefetch_hits: int = 0  # hits on a prefetched expert before any other use


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"expert cache policy {policy!r} (known: {', '.join(POLICIES)})")


class SlotMap:
    def __init__(self, num_experts: int, num_slots: int, policy: str = "lru", static: int = 0) -> None:
        check_policy(policy)
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"expert cache slots: {num_slots} not in [1, {num_experts}]")
        if not 0 <= static < num_slots:
            raise ValueError(f"static experts: {static} must leave a dynamic slot of the {num_slots}")
        self.num_experts, self.num_slots, self.policy, self.static = num_experts, num_slots, policy, static
        self.null = num_slots  # the slot index of "not resident"
        self.slot_of = np.full(num_experts, self.null, dtype=np.int64)  # [E]
        self.expert_in = np.full(num_slots, -1, dtype=np.int64)  # [S], -1: empty
        self.slot_of[:static] = self.expert_in[:static] = np.arange(static)  # expert e in slot e
        self.last_use = np.full(num_slots, -1, dtype=np.int64)  # [S] tick of the last use
        self.pin_step = np.full(num_slots, -1, dtype=np.int64)  # [S] pinned while == step
        self.prefetched = np.zeros(num_slots, dtype=bool)  # [S] inserted ahead, not used since
        self.freq = np.zeros(num_experts, dtype=np.float64)  # [E] decayed use counts
        self.decay = 0.5 ** (1.0 / LFU_HALF_LIFE)
        self.step = 0
        self.tick = 0
        self.counts = SlotCounts()
        self.dirty = True  # slot_of changed since the device table was last written

    # ---- queries
    def resident(self, experts: np.ndarray) -> np.ndarray:
        return self.slot_of[experts] != self.null

    def absent(self) -> np.ndarray:
        """The experts not resident, ascending."""
        return np.flatnonzero(self.slot_of == self.null)

    @property
    def num_resident(self) -> int:
        return int((self.expert_in >= 0).sum())  # static ones included

    @property
    def num_dynamic(self) -> int:
        return self.num_slots - self.static

    def fits(self, experts: np.ndarray) -> bool:
        """Whether a batch's distinct ``experts`` can all be resident at once: the static ones
        always are, the others need a dynamic slot each."""
        return int((np.asarray(experts) >= self.static).sum()) <= self.num_dynamic

    def set_policy(self, policy: str) -> None:
        """Switch the eviction policy of a running cache (``ft bench offline`` compares policies on
        one loaded model). The decayed use counts start afresh, so LFU does not inherit the
        previous measurement's popularity; what is resident stays."""
        check_policy(policy)
        self.policy = policy
        self.freq[:] = 0.0

    def begin_step(self, step: int) -> None:
        self.step = step

    # ---- decisions
    def ensure(self, experts: np.ndarray) -> list[tuple[int, int]] | None:
        """Make every expert of a batch resident and pin them for this step.

        Returns the (expert, slot) copies to make, or None when the batch needs more slots than
        are unpinned (then nothing is evicted or counted; the hits stay pinned).
        """
        experts = np.asarray(experts, dtype=np.int64)
        slots = self.slot_of[experts]
        hit = slots != self.null
        self.pin_step[slots[hit]] = self.step  # hits are never victims
        missing = experts[~hit]
        if len(missing) == 0:  # a decode layer, most often: nothing to choose, insert or publish
            self._count_use(experts, hit)
            return []
        victims = self._victims(len(missing), self._candidates())
        if victims is None:
            return None
        self._count_use(experts, hit)
        copies = self._insert(missing, victims)
        self.pin_step[victims] = self.step
        return copies

    def prefetch(self, experts: np.ndarray) -> list[tuple[int, int]]:
        """Insert what is not resident as far as unpinned slots allow, evicting none of ``experts``;
        pins nothing, counts no use (a prediction is not a use)."""
        experts = np.asarray(experts, dtype=np.int64)
        slots = self.slot_of[experts]
        hit = slots != self.null
        self.tick += 1
        self.last_use[slots[hit]] = self.tick  # predicted: keep them a while
        missing = experts[~hit]
        if len(missing) == 0:
            return []
        cand = self._candidates()
        predicted = np.zeros(self.num_experts + 1, dtype=bool)  # [E + 1]: index -1 (empty) stays False
        predicted[experts] = True
        cand = cand[~predicted[self.expert_in[cand]]]
        n = min(len(missing), len(cand))
        if n == 0:
            return []
        victims = self._victims(n, cand)
        copies = self._insert(missing[:n], victims)
        self.prefetched[victims] = True
        self.counts.prefetched += n
        return copies

    def restart(self) -> list[tuple[int, int]]:
        """Back to the start-up contents: every dynamic slot emptied, then filled as ``warm``
        does, and the use history forgotten (``ft bench offline``'s variants each start from
        it). Arrays change in place (``StackedMaps`` holds views of them). Returns the copies."""
        dynamic = self.expert_in[self.static :]
        self.slot_of[dynamic[dynamic >= 0]] = self.null
        dynamic[:] = -1
        self.last_use[:] = -1
        self.pin_step[:] = -1
        self.prefetched[:] = False
        self.freq[:] = 0.0
        self.dirty = True
        return self.warm()

    def warm(self) -> list[tuple[int, int]]:
        """Fill the empty dynamic slots with the lowest-numbered experts not resident: a start-up
        fill, so the first requests find the residency the plan reports. Counts no use."""
        empty = self.static + np.nonzero(self.expert_in[self.static :] < 0)[0]
        experts = self.absent()[: len(empty)]
        return self._insert(experts, empty[: len(experts)])

    def classify(self, experts: np.ndarray, read_slots: np.ndarray | None = None) -> np.ndarray:
        """Which experts are resident; counts the batch's hits and misses and pins the hits, but
        inserts nothing (the streaming path and the hybrid backend use the hits in place).
        ``read_slots`` (one per expert; host reads): the slot each was read from, or < 0 for the
        host store; those are the hits, counted even if evicted since, and pinned where they
        still are."""
        experts = np.asarray(experts, dtype=np.int64)
        if read_slots is None:
            hit = held = self.resident(experts)
        else:
            hit, held = read_slots >= 0, self.slot_of[experts] == read_slots
        self.pin_step[self.slot_of[experts[held]]] = self.step
        self._count_use(experts, hit, held)
        return hit

    def promote(self, missed: np.ndarray, n: int) -> list[tuple[int, int]]:
        """Insert up to ``n`` of the experts a step ``missed``, most used first (the decayed
        counts), into slots that no expert of this step holds, victims by the policy; with
        ``lfu`` only where the newcomer is used more than the expert it evicts. Returns the
        (expert, slot) copies. Host reads call it between steps: a miss costs no copy there, so
        the cache changes only as fast as ``n`` allows."""
        missed = np.asarray(missed, dtype=np.int64)
        missed = missed[self.slot_of[missed] == self.null]  # one being copied in already has a slot
        cand = self._candidates()
        n = min(n, len(missed), len(cand))
        if n <= 0:
            return []
        new = missed[np.argsort(-self.freq[missed], kind="stable")[:n]]
        victims = self._victims(n, cand)
        if self.policy == "lfu":  # newcomers by falling use, victims by rising use: pair them off
            holder = self.expert_in[victims]
            held = np.where(holder >= 0, self.freq[np.maximum(holder, 0)], -1.0)
            keep = self.freq[new] > held
            new, victims = new[keep], victims[keep]
        if len(new) == 0:
            return []
        self.pin_step[victims] = self.step  # not undone by another promotion of this step
        return self._insert(new, victims)

    # ---- internals
    def _count_use(self, experts: np.ndarray, hit: np.ndarray, held: np.ndarray | None = None) -> None:
        """Count a batch's uses; ``held``: the hits still in their slots (default: all of them)."""
        self.tick += 1
        self.freq *= self.decay
        self.freq[experts] += 1.0
        slots = self.slot_of[experts[hit if held is None else held]]
        self.last_use[slots] = self.tick
        hits = int(np.count_nonzero(hit))
        self.counts.hits += hits
        self.counts.misses += len(experts) - hits
        was_prefetched = self.prefetched[slots]
        if was_prefetched.any():
            self.counts.prefetch_hits += int(np.count_nonzero(was_prefetched))
            self.prefetched[slots] = False

    def _candidates(self) -> np.ndarray:
        """Slots that may be filled now: dynamic and not pinned for this step."""
        return self.static + np.nonzero(self.pin_step[self.static :] != self.step)[0]

    def _victims(self, n: int, cand: np.ndarray) -> np.ndarray | None:
        """The ``n`` candidate slots to fill: empty ones first, then by the policy's order."""
        if len(cand) < n:
            return None
        empty = cand[self.expert_in[cand] < 0]
        if len(empty) >= n:
            return empty[:n]
        if self.policy == "lru":
            # the n oldest, ties to the lower slot: a partition of unique keys, then a sort of n
            key = self.last_use[cand] * (self.num_slots + 1) + cand
            order = np.argpartition(key, n - 1)[:n] if n < len(cand) else np.arange(len(cand))
            order = order[np.argsort(key[order])]
        else:  # by freq, then by recency: the stable sort of the slots at or below the n-th freq
            holder = self.expert_in[cand]
            freq = np.where(holder >= 0, self.freq[np.maximum(holder, 0)], -1.0)
            low = np.flatnonzero(freq <= np.partition(freq, n - 1)[n - 1]) if n < len(cand) else None
            if low is not None:
                cand, freq = cand[low], freq[low]
            order = np.lexsort((self.last_use[cand], freq))
        return cand[order[:n]]

    def _insert(self, experts: np.ndarray, victims: np.ndarray) -> list[tuple[int, int]]:
        old = self.expert_in[victims]
        evicted = old[old >= 0]
        self.counts.evictions += len(evicted)
        self.slot_of[evicted] = self.null
        self.expert_in[victims] = experts
        self.slot_of[experts] = victims
        self.last_use[victims] = self.tick
        self.prefetched[victims] = False
        self.dirty = True
        return list(zip(experts.tolist(), victims.tolist()))


class StackedMaps:
    """Every layer's ``SlotMap`` arrays as the rows of ``[L, E]`` / ``[L, S]`` arrays (each map
    keeps views of its rows, so its own methods see and change the same values), for host reads
    to count a step of every layer in a few array operations instead of a dozen per layer (on an
    H200's host, 2026-12-01, the per-layer loop took ~70 us a layer, 3-4 ms a step for 48)."""

    ARRAYS = ("slot_of", "expert_in", "last_use", "pin_step", "prefetched", "freq")

    def __init__(self, maps: list[SlotMap]) -> None:
        first = maps[0]
        same = {(m.num_experts, m.num_slots, m.decay) for m in maps}
        assert len(same) == 1, f"stacked maps must agree in experts, slots and decay: {same}"
        self.maps = maps
        for name in self.ARRAYS:
            stacked = np.stack([getattr(m, name) for m in maps])
            setattr(self, name, stacked)
            for i, m in enumerate(maps):
                setattr(m, name, stacked[i])
        self.decay = first.decay

    def classify_step(self, uses: np.ndarray, routes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``SlotMap.classify(used, routes[used])`` for every layer at once: ``uses`` [L, E] (> 0:
        used this step), ``routes`` [L, E] the slots the step read (< 0: the host store) -> (used,
        hit) [L, E] bool. Counts and pins exactly as each layer's own call would."""
        maps = self.maps
        used = uses > 0
        hit = used & (routes >= 0)
        held = hit & (self.slot_of == routes)  # hits still in the slot they were read from
        rows, experts = np.nonzero(held)
        slots = self.slot_of[rows, experts]
        self.pin_step[rows, slots] = np.array([m.step for m in maps])[rows]
        ticks = np.array([m.tick for m in maps]) + 1
        self.freq *= self.decay
        self.freq[used] += 1.0
        self.last_use[rows, slots] = ticks[rows]
        was = self.prefetched[rows, slots]
        self.prefetched[rows[was], slots[was]] = False
        per_layer = zip(
            ticks.tolist(), hit.sum(1).tolist(), used.sum(1).tolist(),
            np.bincount(rows[was], minlength=len(maps)).tolist(),
        )  # fmt: skip
        for m, (tick, hits, n, prefetch_hits) in zip(maps, per_layer):
            m.tick = tick
            m.counts.hits += hits
            m.counts.misses += n - hits
            m.counts.prefetch_hits += prefetch_hits
        return used, hit
