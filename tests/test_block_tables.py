"""The ranks' block tables (``ft.engine.block_tables``) kept from the blocks each step sends: they
spell every request's blocks through admission, prefix hits, growth, preemption and slot reuse;
the decode graphs' host rows are filled from them; a decode step's message no longer grows
with the context."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ft.engine.block_tables import BlockTables
from ft.engine.cuda_graph import CudaGraphRunner, Packed, graph_sizes
from ft.sampling_params import SamplingParams
from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.radix_cache import RadixCache
from ft.scheduler.request import Request
from ft.scheduler.scheduler import Scheduler
from ft.scheduler.state_pool import SlotAllocator
from ft.scheduler.step import HISTORY
from tests.scheduler_sim import launch, make, run


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_tables_spell_each_requests_blocks_through_preemption(hybrid, ahead, seed):
    """``scheduler_sim.launch`` checks every batch's rows and KV slots against the requests'."""
    sched, sent = make(Scheduler, 20, hybrid), []
    run(sched, seed, ahead, each_step=lambda t, record, state: sent.extend(record))
    assert sched.num_preemptions > 0 and sched.prefix_hit_tokens > 0
    resent = [r for r in sent if r[4] > 0]  # steps that sent only the blocks added since
    assert resent and sum(len(r[3]) for r in sent) < sum(r[4] + len(r[3]) for r in sent) / 2


def test_a_decode_step_sends_what_it_adds_not_its_whole_table():
    blocks, slots = BlockAllocator(2100, 16), SlotAllocator(2)
    sched, state = Scheduler(blocks, slots, 2, 40000, 40000, RadixCache(16)), {}
    sched.add(Request("long", list(range(32768)), SamplingParams(max_tokens=100, ignore_eos=True)))
    (prefill,) = sched.schedule().seqs
    launch(sched, [prefill], state)
    assert prefill.blocks_from == 0 and len(prefill.new_blocks) == 2048
    req, sizes = sched.requests["long"], []
    for _ in range(40):
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(1)
        (seq,) = sched.schedule().seqs
        launch(sched, [seq], state)
        sizes.append(len(pickle.dumps(seq)))
    assert max(sizes) < 1000 and len(pickle.dumps(prefill)) > 4 * 2049, sizes


class _Graph:
    def __init__(self, runner: CudaGraphRunner) -> None:
        self.runner, self.seen = runner, []

    def replay(self) -> None:  # what the captured step would read
        self.seen.append((self.runner.block_tables.clone(), self.runner.slots.clone()))


def _graph_runner(tables: BlockTables, max_bs: int, max_blocks: int) -> CudaGraphRunner:
    g = object.__new__(CudaGraphRunner)  # its host side, without capture
    g.runner = SimpleNamespace(
        tables=tables, scratch_slot=8, cfg=SimpleNamespace(block_size=tables.block_size)
    )
    g.max_bs, g.max_blocks, g.sizes = max_bs, max_blocks, graph_sizes(max_bs)
    dev = torch.device("cpu")
    g.wide = Packed({"ids": 1, "positions": 1, "slots": 1, "state_slots": 1, "history": HISTORY}, max_bs,
                    torch.int64, dev)  # fmt: skip
    g.narrow = Packed(
        {"seq_lens": 1, "context_lens": 1, "block_tables": max_blocks}, max_bs, torch.int32, dev
    )
    g.ids, g.positions, g.slots, g.state_slots, g.history = g.wide.views()
    g.seq_lens, g.context_lens, g.block_tables = g.narrow.views()
    g.table_width = 0
    g.graphs = {bs: _Graph(g) for bs in g.sizes}
    g.logits = {bs: torch.zeros(bs, 3) for bs in g.sizes}
    return g


def _decode(slot: int, start: int, new: list[int], first: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=str(slot), token_ids=[5], start=start, new_blocks=new, blocks_from=first,
        num_blocks=first + len(new), state_slot=slot, history=[1] * HISTORY, params=SamplingParams(),
    )  # fmt: skip


def test_graph_rows_are_the_tables_zero_past_every_width():
    """Batches of every size in turn, slots reused by requests of other lengths: each replay reads
    a row's blocks, -1 to the batch's width, zeros past it and in padding rows; the KV slot of
    each sequence's token."""
    rng = np.random.default_rng(0)
    bs_, max_blocks = 4, 12
    tables = BlockTables(9, max_blocks, bs_)
    g = _graph_runner(tables, 8, max_blocks)
    blocks: dict[int, list[int]] = {}
    for _ in range(60):
        b = int(rng.integers(1, 9))
        seqs = []
        for slot in rng.choice(8, size=b, replace=False).tolist():
            # a new request on the slot, or the one there grown by 0-2 blocks
            fresh = slot not in blocks or len(blocks[slot]) > max_blocks - 2 or rng.random() < 0.3
            old = [] if fresh else blocks[slot]
            new = rng.integers(0, 100, size=int(rng.integers(1 if fresh else 0, 3))).tolist()
            blocks[slot] = old + new
            start = len(blocks[slot]) * bs_ - 1 - int(rng.integers(0, bs_))
            seqs.append(_decode(slot, start, new, len(old)))
        tables.update(seqs)
        g.run(seqs)
        pad = next(s for s in g.sizes if s >= b)
        table, slots = g.graphs[pad].seen[-1]
        width = max(len(blocks[s.state_slot]) for s in seqs)
        for i, s in enumerate(seqs):
            own = blocks[s.state_slot]
            assert table[i, : len(own)].tolist() == own
            assert (table[i, len(own) : width] == -1).all() and (table[i, width:] == 0).all()
            assert slots[i] == own[s.start // bs_] * bs_ + s.start % bs_
        assert (table[b:pad] == 0).all()
