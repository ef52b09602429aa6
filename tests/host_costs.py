"""Host time of the engine's per-step bookkeeping at long contexts and large batches, on the CPU
(not a test; prints a table). ``python tests/host_costs.py``

- a scheduling step while a 260k-token request waits for room beside 8 decoding ones, its first
  200k tokens cached: the refused head matched against the prefix cache every step, and not
  (``Scheduler.refused_again``);
- a decode batch's inputs (KV slots, block table) for B sequences of L tokens: every request's
  block list rebuilt into a table each step (as before ``ft.engine.block_tables``), and the rows
  the ranks keep; and the pickled size of the step each rank is sent;
- penalties (repetition 1.05) of B rows with 8k-token prompts: the prompts' ids uploaded each
  step (the stateless path), and the counts kept per slot (``ft.layers.penalties``). The vocab
  is 151,936; on a CPU the [B, V] arithmetic is in both rows, so the difference is the host work.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ft.engine.batch_inputs import batch_inputs as runner_inputs  # noqa: E402
from ft.engine.block_tables import BlockTables  # noqa: E402
from ft.layers.sampler import Sampler  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from ft.scheduler.kv_pool import BlockAllocator  # noqa: E402
from ft.scheduler.radix_cache import RadixCache  # noqa: E402
from ft.scheduler.request import Request  # noqa: E402
from ft.scheduler.scheduler import Scheduler  # noqa: E402
from ft.scheduler.state_pool import SlotAllocator  # noqa: E402
from ft.scheduler.step import ScheduledSeq  # noqa: E402
from tests.scheduler_sim import step  # noqa: E402


def timed(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


class AlwaysRetry(Scheduler):
    def refused_again(self, req, budget):
        return False


def refused_head(cls) -> float:
    rng = random.Random(0)
    long = [rng.randrange(150000) for _ in range(200_000)]
    s = cls(BlockAllocator(16384, 16), SlotAllocator(64), 64, 16384, 262144, RadixCache(16))
    s.add(Request("turn1", long, SamplingParams(max_tokens=1, temperature=0.0)))
    state: dict = {}
    while s.has_unfinished():
        step(s, False, state)
    for i in range(8):
        prompt = [rng.randrange(150000) for _ in range(4000)]
        s.add(Request(f"d{i}", prompt, SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)))
    for _ in range(3):
        step(s, False, state)
    more = [rng.randrange(150000) for _ in range(60000)]
    s.add(Request("turn2", long + more, SamplingParams(max_tokens=1, temperature=0.0)))
    ms = timed(lambda: step(s, False, state), 50)
    assert s.waiting and s.waiting[0].request_id == "turn2"
    return ms


def rebuilt(seqs, full: list[list[int]], bs: int) -> None:
    """The per-step table of before: each request's whole block list, then a tensor."""
    slots = [blocks[s.start // bs] * bs + s.start % bs for s, blocks in zip(seqs, full)]
    width = max(len(b) for b in full)
    table = [b for blocks in full for b in blocks + [-1] * (width - len(blocks))]
    torch.tensor(slots), torch.tensor(table).view(len(seqs), width)


def batch_inputs(b: int, ctx: int) -> tuple[float, float, int, int]:
    nb, p = ctx // 16, SamplingParams()
    full = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]
    tables = BlockTables(b + 1, nb + 1, 16)
    tables.update([ScheduledSeq(f"r{i}", [5], 0, full[i], 0, i, False, p, 0, None) for i in range(b)])
    seqs = [
        ScheduledSeq(f"r{i}", [5], ctx - 1, [], nb, i, True, p, 3, None, history=[1] * 8) for i in range(b)
    ]
    old = [
        ScheduledSeq(f"r{i}", [5], ctx - 1, full[i], 0, i, True, p, 3, None, history=[1] * 8)
        for i in range(b)
    ]
    before = timed(lambda: rebuilt(seqs, full, 16), 10)
    now = timed(lambda: (tables.update(seqs), runner_inputs(seqs, tables, 0, False, torch.device("cpu"))), 10)
    return before, now, len(pickle.dumps(old)), len(pickle.dumps(seqs))


def penalties(b: int, prompt: int) -> tuple[float, float]:
    v, rng = 151936, random.Random(1)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.05)] * b
    seen = [
        ([rng.randrange(v) for _ in range(prompt)], [rng.randrange(v) for _ in range(100)]) for _ in range(b)
    ]
    logits, s, rows = torch.randn(b, v), Sampler(torch.device("cpu"), 0), [(i, f"r{i}") for i in range(b)]
    s.tokens(logits, params, [0] * b, seen, rows)
    return timed(lambda: s.tokens(logits, params, [0] * b, seen), 3), timed(
        lambda: s.tokens(logits, params, [0] * b, None, rows), 3
    )


if __name__ == "__main__":
    w = 58
    print(f"{'what':<{w}} {'before':>12} {'now':>12}")
    print(f"{'scheduling step, a 260k-token head refused':<{w}} {refused_head(AlwaysRetry):>9.2f} ms "
          f"{refused_head(Scheduler):>9.2f} ms")  # fmt: skip
    for b, ctx in ((64, 8192), (64, 32768), (256, 4096)):
        before, now, old_size, new_size = batch_inputs(b, ctx)
        print(f"{f'decode inputs, {b} x {ctx} tokens':<58} {before:>9.2f} ms {now:>9.2f} ms")
        print(
            f"{f'  a step pickled for each rank, {b} x {ctx} tokens':<58} {old_size:>9,} B  {new_size:>9,} B"
        )
    before, now = penalties(64, 8192)
    print(
        f"{'penalties, 64 rows x 8k-token prompts (incl. [B, V] math)':<58} {before:>9.1f} ms {now:>9.1f} ms"
    )
