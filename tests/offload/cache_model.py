"""An independent count of what the offload backend's statistics must be, from the routing a run
recorded (``Recorder``): every layer's cache simulated from first principles and the counters
counted as ft defines them.

- A *use* is a (layer, expert) that one forward routes at least one real token to, however many
  tokens do; a *hit*, a use whose expert sat in one of the layer's cache slots when the forward
  read it; a *miss*, any other use. Hit rate = hits / uses.
- The cache: S slots a layer, filled at start-up with experts 0..S-1 (not counted). A decode batch
  whose experts fit copies its misses into the slots of the oldest (LRU) or least used (LFU:
  uses decayed by half every 64 calls, ties to the oldest) experts it does not use, an eviction
  each; a streamed batch (prefill) copies its misses through staging and inserts nothing; with
  host reads a decode batch reads its misses from the host (each (token, expert) pair reads the
  expert's bytes) and a layer promotes 1/16 of its misses (credited across steps, most used
  first) between steps, a step late. With prefetch, the next layer's router on this layer's input
  names experts copied into that layer's slots ahead of need (a prefetched expert counts a
  prefetch hit when it is first used).
- Bytes copied: one expert row per copy; tokens: the real tokens of every forward.

Not here: streaming ahead and pre-staging (their copies add bytes: tests switch them off).
"""

from __future__ import annotations

import numpy as np

from ft.forward_context import get_forward_context

HALF_LIFE = 64.0  # calls of a layer
PROMOTE_SHARE = 1 / 16
READS_MAX_TOKENS = 4  # decode batches host reads take on a CPU


class Recorder:
    """Wraps a MoE block's backend: records each call's (layer, ids [T, k] of the real rows, decode
    only, the prefetch router's picks for the next layer or None), then runs the backend."""

    def __init__(self, inner, layer: int, calls: list) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_at", (layer, calls))

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def __call__(self, bank, x, weights, ids, *args, **kwargs):
        batch = get_forward_context().batch
        real = (batch.slot_mapping[: len(x)] >= 0).cpu().numpy()
        pf = getattr(self._inner, "prefetch", None)
        picks = pf.gate(x)[1].cpu().numpy()[real] if pf is not None else None
        layer, calls = self._at
        calls.append((layer, ids.cpu().numpy()[real], batch.is_decode_only, picks))
        return self._inner(bank, x, weights, ids, *args, **kwargs)


def record(blocks: list) -> list:
    """Wrap every MoE block's backend; returns the list its calls go to."""
    calls: list = []
    for i, block in enumerate(blocks):
        block.backend = Recorder(block.backend, i, calls)
    return calls


class Layer:
    def __init__(self, experts: int, slots: int, policy: str) -> None:
        self.policy, self.slots = policy, slots
        self.held = list(range(slots))  # slot -> expert
        self.last = [0] * slots  # slot -> tick of its last use or insertion
        self.ahead = [False] * slots  # prefetched, not used since
        self.tick = 0
        self.freq = np.zeros(experts)
        self.n = dict(hits=0, misses=0, evictions=0, prefetched=0, prefetch_hits=0)

    def slot(self, e: int) -> int | None:
        return self.held.index(e) if e in self.held else None

    def use(self, used: list[int], resident: dict[int, int]) -> tuple[list[int], set[int]]:
        """Count a forward's uses against ``resident`` (expert -> slot as it read them); returns
        the misses and the slots of the hits still held (pinned for the step)."""
        self.tick += 1
        self.freq *= 0.5 ** (1 / HALF_LIFE)
        self.freq[used] += 1
        hits = [e for e in used if e in resident]
        pinned = {resident[e] for e in hits if self.slot(e) == resident[e]}
        for s in pinned:
            self.last[s] = self.tick
            self.n["prefetch_hits"] += self.ahead[s]
            self.ahead[s] = False
        self.n["hits"] += len(hits)
        self.n["misses"] += len(used) - len(hits)
        return [e for e in used if e not in resident], pinned

    def victims(self, n: int, free: list[int]) -> list[int]:
        def score(s):
            return (self.freq[self.held[s]], self.last[s], s) if self.policy == "lfu" else (self.last[s], s)

        return sorted(free, key=score)[:n]

    def insert(self, experts: list[int], slots: list[int], ahead: bool = False) -> int:
        for e, s in zip(experts, slots):
            self.n["evictions"] += 1
            self.held[s], self.last[s], self.ahead[s] = e, self.tick, ahead
        return len(experts)

    def resident(self) -> dict[int, int]:
        return {e: s for s, e in enumerate(self.held)}

    def prefetch(self, picks: list[int]) -> int:
        self.tick += 1
        for e in picks:
            if self.slot(e) is not None:
                self.last[self.slot(e)] = self.tick
        missing = [e for e in picks if self.slot(e) is None]
        free = [s for s in range(self.slots) if self.held[s] not in picks]
        n = min(len(missing), len(free))
        self.n["prefetched"] += n
        return self.insert(missing[:n], self.victims(n, free), ahead=True)

    def promote(self, missed: list[int], n: int, pinned: set[int]) -> int:
        missed = [e for e in missed if self.slot(e) is None]
        free = [s for s in range(self.slots) if s not in pinned]
        n = min(n, len(missed), len(free))
        new = sorted(missed, key=lambda e: (-self.freq[e], e))[:n]
        slots = self.victims(n, free)
        if self.policy == "lfu":  # only where the newcomer is used more than the one it evicts
            keep = [(e, s) for e, s in zip(new, slots) if self.freq[e] > self.freq[self.held[s]]]
            new, slots = [e for e, _ in keep], [s for _, s in keep]
        return self.insert(new, slots)


def expected(
    calls: list, experts: int, slots: int, policy: str, reads: bool, expert_bytes: int, payload: int
) -> dict:
    """The counters ``calls`` (``record``'s) must give: an engine of ``slots`` slots a layer of
    ``experts``, its eviction ``policy``, host reads on or off, ``expert_bytes`` a row copied and
    ``payload`` bytes of it read in place."""
    layers = [Layer(experts, slots, policy) for _ in range(len({c[0] for c in calls}))]
    copied = read = tokens = 0
    credit = np.zeros(len(layers))
    queued = None  # a host-read step, counted once the next step has run (as ft defers it)

    def count_reads(step):
        nonlocal copied, read, credit
        missed = []
        for layer, used, resident, ids in step:
            miss, pinned = layers[layer].use(used, resident)
            read += sum(int((ids == e).sum()) for e in miss) * payload
            missed.append((miss, pinned))
        credit += PROMOTE_SHARE * np.array([len(m) for m, _ in missed])
        owed = np.floor(credit)
        credit -= owed
        for layer, ((miss, pinned), n) in enumerate(zip(missed, owed.astype(int).tolist())):
            copied += layers[layer].promote(miss, n, pinned) * expert_bytes if n else 0

    forwards = np.cumsum([c[0] == 0 for c in calls])
    for f in range(1, forwards[-1] + 1):
        step = [c for c, g in zip(calls, forwards) if g == f]
        tokens += len(step[0][1])
        by_reads = reads and step[0][2] and len(step[0][1]) <= READS_MAX_TOKENS
        held = []
        for layer, ids, decode, picks in step:
            cache = layers[layer]
            used = sorted(set(ids.reshape(-1).tolist()))
            if by_reads:
                held.append((layer, used, cache.resident(), ids))
                continue
            miss, pinned = cache.use(used, cache.resident())
            copied += len(miss) * expert_bytes
            if decode and len(used) <= slots:  # copied into the slots the batch does not use
                free = [s for s in range(slots) if s not in pinned]
                cache.insert(miss, cache.victims(len(miss), free))
            if picks is not None and layer + 1 < len(layers):
                guess = sorted(set(picks.reshape(-1).tolist()))
                if len(guess) <= slots:
                    copied += layers[layer + 1].prefetch(guess) * expert_bytes
        if queued is not None:
            count_reads(queued)
        queued = held if by_reads else None
    if queued is not None:
        count_reads(queued)
    out = {f"moe_{k}": sum(c.n[k] for c in layers) for k in layers[0].n}
    return out | dict(moe_bytes_h2d=copied, moe_bytes_host_read=read, moe_tokens=tokens)
