"""The engine's loop without a model, for scheduler tests: batches scheduled (and scheduled
ahead) as ``LLMEngine.step`` does, each chunk "computed", each decode drawing a token that depends
only on the request and position, and the ranks' block tables (``ft.engine.block_tables``) kept
from the batches as a runner keeps them, checked against the scheduler's own lists every batch."""

from __future__ import annotations

import random

import numpy as np

from ft.engine.block_tables import BlockTables
from ft.sampling_params import SamplingParams
from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.radix_cache import RadixCache
from ft.scheduler.request import Request
from ft.scheduler.scheduler import Scheduler
from ft.scheduler.state_pool import SlotAllocator


def make(cls, num_blocks: int, hybrid: bool, budget: int = 24, block_size: int = 4) -> Scheduler:
    cache = RadixCache(block_size, num_snapshots=6 if hybrid else 0)
    return cls(BlockAllocator(num_blocks, block_size), SlotAllocator(6), 6, budget, 256, cache, hybrid=hybrid)


def launch(sched: Scheduler, seqs: list, state: dict) -> None:
    """What a runner does with a batch's blocks: its tables take them, and they must spell each
    request's blocks (the requests scheduled ahead of a step that ended them aside)."""
    if "tables" not in state:
        state["tables"] = BlockTables(sched.slots.num_slots, sched.blocks.num_blocks, sched.blocks.block_size)
    tables = state["tables"]
    tables.update(seqs)
    live = [s for s in seqs if s.request_id in sched.requests]
    for s in live:
        assert tables.rows[s.state_slot, : s.num_blocks].tolist() == sched.requests[s.request_id].block_ids
        assert (tables.rows[s.state_slot, s.num_blocks :] == -1).all()
    want = [
        b * sched.blocks.block_size + p % sched.blocks.block_size
        for s in live
        for p in range(s.start, s.start + len(s.token_ids))
        for b in [sched.requests[s.request_id].block_ids[p // sched.blocks.block_size]]
    ]
    assert not live or tables.kv_slots(live).tolist() == want
    assert tables.table(live, 3).shape == (len(live), 3) and tables.kv_slots(live).dtype == np.int64


def step(sched: Scheduler, ahead: bool, state: dict) -> list:
    """One engine step: the batch scheduled ahead by the last step, or a new one; with ``ahead``,
    the next one scheduled (and launched) while it "runs"; then each chunk computed and a
    decode's token drawn. Returns what the step sent: (id, tokens, start, new blocks, from, snapshot)."""
    seqs = state.pop("ahead", None)
    if seqs is None:
        seqs = sched.schedule().seqs
        launch(sched, seqs, state)
    record = [(s.request_id, tuple(s.token_ids), s.start, tuple(s.new_blocks), s.blocks_from, s.snapshot_to)
              for s in seqs]  # fmt: skip
    nxt = sched.schedule_ahead(seqs) if ahead and seqs else None
    if nxt is not None:
        launch(sched, nxt, state)
        state["ahead"] = nxt
    for seq in seqs:
        req = sched.requests.get(seq.request_id)
        if req is None:  # ended by the step before its step ahead
            sched.discard(seq)
            continue
        req.num_computed_tokens += len(seq.token_ids)
        sched.cache_computed(req, seq)
        if seq.sample:
            req.output_token_ids.append((sum(map(ord, req.request_id)) + req.num_tokens) % 7)
            if len(req.output_token_ids) >= req.params.max_tokens:
                sched.finish(req, "length")
    return record


def workload(seed: int, n: int = 60) -> list[tuple[int, Request]]:
    """(arrival step, request) of ``n`` requests over four shared prefixes, by arrival."""
    rng = random.Random(seed)
    stems = [[rng.randrange(7) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(7) for _ in range(rng.randrange(0, 12))]
        prompt = rng.choice(stems)[: rng.randrange(1, 40)] + tail
        params = SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
        reqs.append((rng.randrange(0, 3 * n), Request(f"r{i}", prompt or [1], params)))
    return sorted(reqs, key=lambda t: t[0])


def run(sched: Scheduler, seed: int, ahead: bool = False, each_step=None, before_step=None) -> None:
    """``workload(seed)`` through ``sched`` to the end; ``before_step(t, state)`` once the step's
    arrivals are added, ``each_step(t, record, state)`` after it."""
    pending, state = workload(seed), {}
    for t in range(2000):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[1])
        if before_step is not None:
            before_step(t, state)
        record = step(sched, ahead, state)
        if each_step is not None:
            each_step(t, record, state)
        if not sched.has_unfinished() and not pending:
            return
    raise AssertionError("the workload did not finish")
