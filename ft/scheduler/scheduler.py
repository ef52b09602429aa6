"""Continuous batching with chunked prefill, admission against KV blocks and state slots, and
preemption by recompute.

Each ``schedule()`` builds one batch within ``max_num_batched_tokens``: running requests first
(a decode token, or the next chunk of a prompt still being prefilled), then waiting requests in
arrival order while blocks, slots and the token budget allow. When a running request needs a
block and none is free, the most recently admitted request is preempted: its blocks and slot are
freed and it goes back to the front of the queue, to be recomputed from its tokens. Nothing is
dropped: a request that could never fit is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ft.sampling_params import SamplingParams
from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.request import Request, Status
from ft.scheduler.state_pool import SlotAllocator


@dataclass(frozen=True)
class ScheduledSeq:
    """What every rank needs to run one sequence for one step (picklable, no tensors)."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0]; tokens before it are cached
    block_ids: list[int]
    state_slot: int
    sample: bool  # this step reaches the last known token: sample the next one
    params: SamplingParams
    output_index: int  # how many tokens the request has generated so far (seeds sampling)
    prompt_targets: list[int] | None  # prompt tokens whose log-probs this chunk's logits give


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(
        self,
        blocks: BlockAllocator,
        slots: SlotAllocator,
        max_running: int,
        max_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.blocks, self.slots = blocks, slots
        self.max_running = min(max_running, slots.num_slots)
        self.max_batched_tokens, self.max_model_len = max_batched_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.num_preemptions = 0

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
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(
                f"request needs {total} tokens of KV cache; the pool holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}"
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
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.slots.num_free == 0 or not self._grow(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.state_slot = self.slots.allocate()
            req.status = Status.RUNNING
            self.running.append(req)
            seqs.append(self._scheduled(req, n))
            budget -= n
        return SchedulerOutput(seqs, preempted)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        req.block_ids.extend(self.blocks.allocate(need))
        return True

    def _scheduled(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start : start + n]
        targets = None
        if req.wants_prompt_logprobs:
            targets = req.prompt_token_ids[start + 1 : min(start + n + 1, req.prompt_len)]
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=tokens,
            start=start,
            block_ids=list(req.block_ids),
            state_slot=req.state_slot,
            sample=start + n == req.num_tokens,
            params=req.params,
            output_index=len(req.output_token_ids),
            prompt_targets=targets,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status, req.num_computed_tokens = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        req.block_ids = []
        if req.state_slot is not None:
            self.slots.free(req.state_slot)
            req.state_slot = None
