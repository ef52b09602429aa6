"""The waiting head's last refusal for want of KV blocks, remembered so that the scheduler need
not match a long prompt against the prefix cache again each step while nothing it needs changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ft.scheduler.radix_cache import Node, RadixCache
from ft.scheduler.request import Request


@dataclass(frozen=True)
class Refusal:
    """Why the waiting head was last refused, and what changes it: more room, a smaller budget,
    a longer cached prefix (``repeats``)."""

    req: Request
    room: int  # blocks free or evictable after the refusal
    budget: int  # the tokens the step had left for it
    # the last cached block its tokens matched (the root: none; None: no cache look-up); it may
    # be the whole last block, one past what a hit may take
    matched: Node | None
    snapshots: int  # the cache's snapshot changes on its prefix by then (a hybrid model's hit ends at one)
    held: int  # blocks of the hit it held until refused

    def repeats(
        self, req: Request, budget: int, room: int, cache: RadixCache | None, block_size: int
    ) -> bool:
        """Whether admitting waiting ``req`` with ``budget`` tokens left and ``room`` blocks free or
        evictable would fail as it last did, so its prefix match (16,384 blocks for a 262k prompt:
        ~7 ms) need not be redone each step: it was refused and since then no blocks came free or
        evictable, the budget (so its chunk, so the blocks it needs) did not shrink, and its tokens
        match no further in the cache (nor, on a hybrid model, did a snapshot appear that a hit
        may end at). Others then only take blocks, and a preempted request goes before it, so
        those tell every way it could fit (one taking unreferenced cached copies for its own
        blocks, which its hit may hold, ends the refusal: ``Scheduler.cache_computed``)."""
        if req is not self.req or room > self.room or budget < self.budget:
            return False
        if self.matched is None:
            return True
        if cache.head_changes != self.snapshots:
            return False
        bs = block_size
        limit = (req.num_tokens - 1) // bs
        tail = self.matched if self.matched.depth <= limit else self.matched.parent  # the last a hit may take
        depth = tail.depth
        key = tuple(req.tokens(depth * bs, (depth + 1) * bs)) if depth < limit else None
        return not cache.extends(tail, key)
