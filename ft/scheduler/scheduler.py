"""Continuous batching with chunked prefill, admission against KV blocks and state slots, and
preemption by recompute, and prefix caching (``prefix``, over the tree of ``radix_cache``).

Each ``schedule()`` builds one batch within ``max_num_batched_tokens``: running requests first
(a decode token, or the next chunk of a prompt still being prefilled), then waiting requests in
arrival order while blocks, slots and the token budget allow. When a running request needs a
block and none is free, the most recently admitted request is preempted: its blocks and slot are
freed and it goes back to the front of the queue, to be recomputed from its tokens. Nothing is
dropped: a request that could never fit is refused when it is added. A waiting head refused for
want of blocks is not matched against the cache again until something it needs changed
(``refusal``). What a batch carries to the ranks is ``step``.

With a prefix cache, a newly admitted request starts after the longest cached prefix of its
tokens (whole blocks, leaving at least one token to compute; on hybrid models only up to a block
that has a GDN state snapshot). On hybrid models each prefill chunk snapshots the GDN state at
its last block boundary short of the request's last token, wherever in the chunk that falls: the
GDN layers split their delta rule there (``ft.gdn.snapshots``), so a prompt is still one forward.
"""

from __future__ import annotations

from collections import deque

from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.prefix import insert_computed, shared_point, take_hit
from ft.scheduler.radix_cache import RadixCache
from ft.scheduler.refusal import Refusal
from ft.scheduler.request import Request, Status, kv_tokens
from ft.scheduler.state_pool import SlotAllocator
from ft.scheduler.step import HISTORY, PENDING_TOKEN, ScheduledSeq, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        blocks: BlockAllocator,
        slots: SlotAllocator,
        max_running: int,
        max_batched_tokens: int,
        max_model_len: int,
        cache: RadixCache | None = None,
        hybrid: bool = False,
    ) -> None:
        self.blocks, self.slots, self.cache, self.hybrid = blocks, slots, cache, hybrid
        self.max_running = min(max_running, slots.num_slots)
        self.max_batched_tokens, self.max_model_len = max_batched_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.refusal: Refusal | None = None

    # ---- requests in and out
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        total = req.prompt_len + req.params.max_tokens
        if req.prompt_len == 0:
            raise ValueError("the prompt is empty")
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) + max_tokens ({req.params.max_tokens}) = {total}"
                f" exceeds the model's context of {self.max_model_len} tokens"
            )
        kv = kv_tokens(req.prompt_len, req.params.max_tokens)
        if self.blocks.blocks_for(kv) > self.blocks.num_blocks:
            raise ValueError(
                f"request needs {kv} tokens of KV cache; the pool holds {self.blocks.num_tokens}"
            )
        req.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        del self.requests[req.request_id]
        if self.refusal is not None and self.refusal.req is req:
            self._refuse(None)  # nothing of it kept alive

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- building a batch
    def schedule(self) -> SchedulerOutput:
        budget, seqs, preempted = self.max_batched_tokens, [], []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._grow(req, req.num_computed_tokens + n):
                seqs.append(self._scheduled(req, n))
                budget -= n
                i += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.slots.num_free == 0 or self._still_refused(req, budget):
                break
            matched = take_hit(self.cache, req, self.blocks.block_size, self.hybrid)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                held = len(req.cache_nodes)
                self._release(req)
                req.num_computed_tokens = 0
                changes = self.cache.head_changes if self.cache is not None else 0
                self._refuse(Refusal(req, self.room, budget, matched, changes, held))
                break
            self._refuse(None)
            if req.num_preemptions == 0:  # a recompute's hit is its own work again (its output too)
                req.num_cached_tokens = req.num_computed_tokens
                self.prefix_hit_tokens += req.num_cached_tokens
            self.waiting.popleft()
            req.state_slot = self.slots.allocate()
            req.status = Status.RUNNING
            self.running.append(req)
            seqs.append(self._scheduled(req, n))
            budget -= n
        return SchedulerOutput(seqs, preempted)

    def schedule_ahead(self, batch: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """The decode step after ``batch``, scheduled while ``batch`` still runs (its tokens not yet
        known here), or None when that step cannot be known now. It can when ``batch`` decodes
        every running request and no waiting request could be admitted (none waits, every
        running place or state slot is taken, or the head's refusal would repeat: a loaded
        server's steady state), so the next
        ``schedule`` would build the same batch; when no request's token in flight is its last by
        length (a step for it would be wasted for sure); when blocks for one more token each
        are free without preempting anyone; and, with a head only its refusal keeps out, when
        ``batch`` attaches no GDN snapshot on the head's prefix (one could lengthen its hit). A request that
        ``batch`` ends frees its place one step later than without the step ahead.
        Each sequence's token is ``PENDING_TOKEN``: the runner takes it from ``batch``'s samples
        on the device. A request that ``batch`` ends (a stop token) had its step ahead run for
        nothing; the engine drops its result."""
        admits = self.waiting and len(self.running) < self.max_running and self.slots.num_free > 0
        # the next ``schedule`` would leave the head its budget less a decode token a running request
        left = self.max_batched_tokens - len(self.running)
        refused = admits and left > 0  # only the head's refusal may keep it out
        admits = refused and not self._still_refused(self.waiting[0], left)  # none at 0
        if admits or len(batch) != len(self.running):
            return None
        for seq, req in zip(batch, self.running):
            if (
                seq.request_id != req.request_id
                or len(seq.token_ids) != 1
                or seq.start + 1 != req.num_tokens  # a decode of the request's last known token
                or req.num_computed_tokens != seq.start
                or len(req.output_token_ids) + 2 > req.params.max_tokens
                or req.num_tokens + 2 > self.max_model_len
                # a snapshot ``batch`` attaches may lengthen the refused head's hit
                or (refused and seq.snapshot_to is not None and self._on_head_path(req, seq.start + 1))
            ):
                return None
        if not all(self._grow(req, req.num_tokens + 1) for req in self.running):
            return None  # blocks grown so far stay with their requests: the next steps need them
        return [self._ahead(req) for req in self.running]

    def _ahead(self, req: Request) -> ScheduledSeq:
        start = req.num_tokens  # the position of the token in flight
        new, first = self._unsent_blocks(req)
        snapshot, at = self._snapshot(req, start, 1)
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=[PENDING_TOKEN],
            start=start,
            new_blocks=new,
            blocks_from=first,
            state_slot=req.state_slot,
            sample=True,
            params=req.params,
            output_index=len(req.output_token_ids) + 1,
            prompt_targets=None,
            history=req.tokens(max(0, start - HISTORY), start),
            snapshot_to=snapshot,
            snapshot_len=at,
        )

    def _refuse(self, refusal: Refusal | None) -> None:
        """The waiting head's refusal (None: none), its matched prefix marked in the cache, where
        a snapshot attached or dropped may change its hit (``RadixCache.head_changes``)."""
        if self.cache is not None and (refusal is not None or self.refusal is not None):
            self.cache.mark_head(refusal.matched if refusal is not None else None)
        self.refusal = refusal

    def _on_head_path(self, req: Request, end: int) -> bool:
        """Whether a decode snapshot of ``req``'s tokens up to ``end`` (a block boundary) may lie
        on the refused head's prefix, where it could lengthen the head's hit: its block's parent
        is on the head's matched prefix (or is not cached yet: a step scheduled ahead of its last
        one's fold) and its tokens are the head's."""
        r = self.refusal
        if r is None or r.matched is None:
            return False
        bs = self.blocks.block_size
        depth = end // bs
        if depth >= 2:
            if len(req.cache_nodes) < depth - 1:
                return True
            if not req.cache_nodes[depth - 2].on_head:
                return False
        head = r.req
        return head.num_tokens >= end and head.tokens(end - bs, end) == req.tokens(end - bs, end)

    def refused_again(self, req: Request, budget: int) -> bool:
        """Whether admitting waiting ``req`` with ``budget`` tokens left would fail as it last did
        (``Refusal.repeats``), so its prefix match need not be redone this step."""
        r = self.refusal
        return r is not None and r.repeats(req, budget, self.room, self.cache, self.blocks.block_size)

    def _still_refused(self, req: Request, budget: int) -> bool:
        """``refused_again``, and if so the head's cached prefix left as recent as the retry it
        skips would leave it (matched, its held blocks released), so growth evicts others first."""
        if not self.refused_again(req, budget):
            return False
        if self.refusal.matched is not None:
            self.cache.touch(self.refusal.matched, self.refusal.held)
        return True

    @property
    def room(self) -> int:
        """Blocks free, or cached and unreferenced (evicted on demand)."""
        return self.blocks.num_free + (self.cache.num_evictable if self.cache is not None else 0)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need) and self.cache is not None:
            self.blocks.free(self.cache.evict(need - self.blocks.num_free))
        if not self.blocks.can_allocate(need):
            return False
        req.block_ids.extend(self.blocks.allocate(need))
        return True

    def _scheduled(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        tokens = req.tokens(start, start + n)
        targets = None
        if req.wants_prompt_logprobs:
            targets = req.prompt_token_ids[start + 1 : min(start + n + 1, req.prompt_len)]
        snapshot, at = self._snapshot(req, start, n)
        restore, req.restore_snapshot = req.restore_snapshot, None
        sample = start + n == req.num_tokens
        seen = None
        if sample and req.params.penalises and not req.penalties_sent:  # the sampler keeps them from here
            seen, req.penalties_sent = (req.prompt_token_ids, req.output_token_ids), True
        new, first = self._unsent_blocks(req)
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=tokens,
            start=start,
            new_blocks=new,
            blocks_from=first,
            state_slot=req.state_slot,
            sample=sample,
            params=req.params,
            output_index=len(req.output_token_ids),
            prompt_targets=targets,
            history=req.tokens(max(0, start - HISTORY), start),
            restore_from=restore,
            snapshot_to=snapshot,
            snapshot_len=at,
            seen=seen,
        )

    def _snapshot(self, req: Request, start: int, n: int) -> tuple[int | None, int]:
        """(the snapshot slot a step of ``req``'s tokens [start, start + n) saves its GDN state
        into, after how many of them), on a hybrid model with a prefix cache, else (None, 0)."""
        if not (self.hybrid and self.cache is not None):
            return None, 0
        bs = self.blocks.block_size
        decode = req.decodes(start, n)
        if decode:  # the state after its token, if that fills a block: a chat's next turn hits the
            # generated tokens. Only from a free slot (a prompt's snapshot, shared more, is never
            # dropped for one), and not on a refused head's prefix: a snapshot there could let it
            # in, so no decode could be scheduled ahead of the step that attaches it
            at = n if (start + n) % bs == 0 and not self._on_head_path(req, start + n) else 0
        else:  # a shared block lacking a snapshot, else the last boundary in (start, start + n]
            # that a later request could hit
            last = min(start + n, req.num_tokens - 1) // bs * bs - start
            at = shared_point(self.cache, req, start, n, bs) or last
        snapshot = self.cache.take_snapshot_slot(evict=not decode) if at > 0 else None
        return snapshot, at if snapshot is not None else 0

    @staticmethod
    def _unsent_blocks(req: Request) -> tuple[list[int], int]:
        """The blocks of ``req`` the ranks have not been sent, and the index of the first: what
        its step now carries."""
        first, req.blocks_sent = req.blocks_sent, len(req.block_ids)
        return req.block_ids[first:], first

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status, req.num_computed_tokens = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def discard(self, seq: ScheduledSeq) -> None:
        """A scheduled step whose result is not folded (its request aborted or ended meanwhile):
        the snapshot slot it took goes back."""
        if seq.snapshot_to is not None:
            self.cache.give_back_snapshot(seq.snapshot_to)

    def cache_computed(self, req: Request, seq: ScheduledSeq) -> None:
        """After a step: enter the request's newly full blocks (and a state snapshot) into the cache."""
        if self.cache is not None:
            evictable = self.cache.num_evictable
            self.blocks.free(insert_computed(self.cache, req, seq, self.blocks.block_size))
            if self.cache.num_evictable < evictable:  # it took unreferenced copies for its own blocks:
                # as much room, but a refused head's hit may hold them (room it could not use)
                self._refuse(None)

    def _release(self, req: Request) -> None:
        if self.cache is not None:
            self.cache.release(req.cache_nodes)  # its leading blocks: the cache keeps them
        self.blocks.free(req.block_ids[len(req.cache_nodes) :])
        req.block_ids, req.cache_nodes, req.restore_snapshot = [], [], None
        req.decode_snapshot = None
        req.blocks_sent, req.penalties_sent = 0, False
        if req.state_slot is not None:
            self.slots.free(req.state_slot)
            req.state_slot = None
