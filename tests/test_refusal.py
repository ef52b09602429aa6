"""A waiting head refused for want of KV blocks is not matched against the prefix cache again
until something it needs changed (``Scheduler.refused_again``): each step it skips is one a
retrying scheduler would refuse too, a blocked long prompt is matched once, not every step, and
its cached prefix stays as recent as retries kept it."""

from __future__ import annotations

import copy

import pytest

from ft.sampling_params import SamplingParams
from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.radix_cache import RadixCache
from ft.scheduler.request import Request, Status
from ft.scheduler.scheduler import Scheduler
from ft.scheduler.state_pool import SlotAllocator
from tests.scheduler_sim import make, run, step


class AlwaysRetry(Scheduler):
    def refused_again(self, req, budget):
        return False


class Counting(Scheduler):
    skips = 0

    def refused_again(self, req, budget):
        again = super().refused_again(req, budget)
        self.skips += again
        return again


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize(
    "blocks, budget, seed", [(20, 8, 0), (20, 16, 1), (20, 24, 2), (28, 24, 2), (40, 64, 5)]
)
def test_each_skipped_attempt_is_one_a_retry_would_refuse(hybrid, blocks, budget, seed):
    """From the state of every step, a scheduler that retries the head builds the same batch. (Runs
    of the two apart drift: a failed retry evicts what it can before it gives up.)"""
    sched, want = make(Counting, blocks, hybrid, budget=budget), []

    def before(t, state):
        probe = copy.deepcopy(sched)
        probe.__class__ = AlwaysRetry
        want.append([(s.request_id, s.start, len(s.token_ids)) for s in probe.schedule().seqs])

    def after(t, record, state):
        assert [(r[0], r[2], len(r[1])) for r in record] == want[-1], f"step {t}"

    run(sched, seed, each_step=after, before_step=before)
    assert sched.skips > 20


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_step_ahead_beside_a_refused_head_is_the_batch_schedule_builds(hybrid, seed):
    """A refused head no longer keeps a loaded server from scheduling its decode ahead: each such
    step is the one a retrying ``schedule`` would build, the head still waiting."""
    sched, checked = make(Scheduler, 20, hybrid), []

    def check(t, record, state):
        if "ahead" in state and sched.waiting:
            probe = copy.deepcopy(sched)
            probe.__class__ = AlwaysRetry
            head = probe.waiting[0]
            built = [(s.request_id, s.start, s.num_blocks) for s in probe.schedule().seqs]
            assert built == [(s.request_id, s.start, s.num_blocks) for s in state["ahead"]], f"step {t}"
            assert head.status is Status.WAITING
            checked.append(t)

    run(sched, seed, ahead=True, each_step=check)
    assert len(checked) > 20


def test_a_blocked_long_prompt_is_matched_once_until_room_comes():
    sched, state = make(Scheduler, 40, hybrid=False, budget=256), {}
    matches = []
    match = sched.cache.match
    sched.cache.match = lambda tokens: matches.append(len(tokens)) or match(tokens)
    decode = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sched.add(Request("short", list(range(12)), decode))
    step(sched, False, state)  # its prefill: 3 blocks, growing as it decodes
    long = Request("long", [5] * 150, SamplingParams(max_tokens=1, temperature=0.0))
    sched.add(long)  # one 150-token chunk: 38 blocks of the 37 free
    for _ in range(5):
        step(sched, False, state)
    assert sched.refusal is not None and sched.refusal.req is long
    assert matches == [12, 150]  # each once, not once a step
    sched.finish(sched.requests["short"], "abort")  # its blocks come free
    step(sched, False, state)
    assert matches == [12, 150, 150] and long.num_computed_tokens == 150 and sched.refusal is None


@pytest.mark.parametrize("hybrid", [False, True])
def test_what_may_let_the_head_in_brings_a_new_attempt(hybrid):
    sched, state = make(Scheduler, 12, hybrid=hybrid, budget=64), {}
    shared = list(range(8))
    sched.add(Request("first", shared, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    sched.add(Request("second", [6] * 30, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    step(sched, False, state)  # 2 + 8 blocks, the first's prompt cached (on a hybrid model its snapshot too)
    waiting = Request("third", shared + [3] * 14, SamplingParams(max_tokens=1))
    sched.add(waiting)  # its 22 tokens need 4 blocks past the 2 it hits: 2 are free
    step(sched, False, state)
    refusal = sched.refusal
    assert refusal is not None and refusal.req is waiting and refusal.matched.depth == 2
    assert waiting.num_computed_tokens == 0 and sched.refused_again(waiting, refusal.budget)
    assert not sched.refused_again(waiting, refusal.budget - 1)  # a smaller chunk may fit
    blocks = sched.blocks.allocate(1)
    assert sched.refused_again(waiting, refusal.budget)  # less room
    sched.blocks.free(blocks)  # as much room as before
    assert sched.refused_again(waiting, refusal.budget)
    sched.blocks.free([sched.requests["second"].block_ids.pop()])  # more
    assert not sched.refused_again(waiting, refusal.budget)
    sched.requests["second"].block_ids.append(sched.blocks.allocate(1)[0])
    node = sched.cache.insert(refusal.matched, (3, 3, 3, 3), block=999)  # its next block, cached since
    assert not sched.refused_again(waiting, refusal.budget)
    sched.cache.release([node])
    assert sched.cache.evict(1) == [999] and sched.refused_again(waiting, refusal.budget)
    if hybrid:  # a snapshot on its path: the hit may now end further on
        sched.cache.attach_snapshot(refusal.matched.parent, sched.cache.take_snapshot_slot())
        assert not sched.refused_again(waiting, refusal.budget)


def test_a_snapshot_dropped_from_the_heads_prefix_brings_a_new_attempt():
    """On a hybrid model a hit ends at a snapshot: one taken off the head's prefix (for a chunk
    that gave it back unused) makes its hit shorter, which may let a budget-bound chunk fit."""
    blocks, slots = BlockAllocator(9, 4), SlotAllocator(4)
    sched, state = Scheduler(blocks, slots, 4, 16, 256, RadixCache(4, num_snapshots=2), hybrid=True), {}
    prefix = list(range(8))
    sched.add(Request("a", prefix + [50], SamplingParams(max_tokens=1, temperature=0.0)))
    step(sched, False, state)  # its prefix cached, a snapshot at its end
    node = sched.cache.match(prefix)[-1]
    sched.add(Request("d", [60] * 13, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    step(sched, False, state)
    head = Request("h", prefix + [70] * 20, SamplingParams(max_tokens=1, temperature=0.0))
    sched.add(head)
    step(sched, False, state)
    assert sched.refusal is not None and sched.refusal.req is head and node.snapshot is not None
    sched.cache.give_back_snapshot(sched.cache.take_snapshot_slot())  # node's, taken and unused
    assert node.snapshot is None and not sched.refused_again(head, sched.max_batched_tokens - 1)
    assert [s.request_id for s in sched.schedule().seqs] == ["d", "h"]


def test_a_refused_heads_prefix_stays_recent():
    """Skipping the match leaves the head's cached prefix as recent as a retry would (matched,
    and the blocks it held released after), so growth evicts other cached blocks before it."""
    sched, state = make(Scheduler, 40, hybrid=False, budget=256), {}
    prefix = list(range(16))
    sched.add(Request("p", prefix, SamplingParams(max_tokens=1, temperature=0.0)))
    step(sched, False, state)  # cached, unreferenced
    sched.add(Request("run", [5] * 100, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    step(sched, False, state)
    head = Request("h", prefix + [3] * 100, SamplingParams(max_tokens=1, temperature=0.0))
    sched.add(head)
    step(sched, False, state)
    assert sched.refusal is not None and sched.refusal.held == 4
    path = [sched.refusal.matched]
    while path[-1].parent is not sched.cache.root:
        path.append(path[-1].parent)
    before = [n.last_use for n in path]
    assert sched.refused_again(head, sched.refusal.budget)
    assert [n.last_use for n in path] == before  # the check alone changes nothing
    assert sched._still_refused(head, sched.refusal.budget)
    assert all(n.last_use > b for n, b in zip(path, before))


def test_a_request_taking_cached_copies_of_the_heads_prefix_brings_a_new_attempt():
    """A request computing blocks cached unreferenced (prompt log-probs: no hit) takes the cached
    copies for its own once they are full (``insert_computed``): as much room as before, but the
    copies were on the refused head's hit, room it could not use, and its own blocks are free
    now, so the head fits, as a retry finds."""
    sched, state = make(Scheduler, 9, hybrid=False, budget=24), {}
    prompt = list(range(1, 17))
    sched.add(Request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    step(sched, False, state)  # 4 blocks cached, unreferenced; 5 free
    logprobs = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    sched.add(Request("b", prompt + [30], logprobs))  # 5 blocks: none free
    head = Request("h", prompt + [40, 41], SamplingParams(max_tokens=1, temperature=0.0))
    sched.add(head)  # hits the 4 cached blocks, needs 1 more: refused
    step(sched, False, state)
    assert head.status is Status.WAITING and sched.blocks.num_free == 4  # b's own, for the copies
    probe = copy.deepcopy(sched)
    probe.__class__ = AlwaysRetry
    assert [s.request_id for s in probe.schedule().seqs] == ["b", "h"]
    assert [s.request_id for s in sched.schedule().seqs] == ["b", "h"]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_refused_head_leaves_the_decode_snapshots_off_its_path(ahead):
    """While a head waits refused, a running reply whose blocks are not on the head's prefix still
    snapshots the blocks it fills (a chat's next turn hits them; under load a head is often
    refused), and its steps are still scheduled ahead: such a snapshot cannot lengthen the
    head's hit."""
    sched, state = make(Scheduler, 14, hybrid=True, budget=64), {}
    reply = Request("r", list(range(1, 9)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    sched.add(reply)
    step(sched, ahead, state)
    head = Request("h", [9] * 52, SamplingParams(max_tokens=1))  # 13 blocks, 11 or fewer free: refused
    sched.add(head)
    decode_snapshots, ahead_steps = 0, 0
    for _ in range(24):
        step(sched, ahead, state)
        assert sched.refusal is not None and sched.refusal.req is head
        decode_snapshots = max(decode_snapshots, sum(n.decode for n in sched.cache._snapshotted))
        ahead_steps += "ahead" in state
    assert decode_snapshots == 1  # the reply's latest
    assert ahead_steps == (24 if ahead else 0)  # every step, those attaching a snapshot too
