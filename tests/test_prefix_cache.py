"""Prefix cache: a hit gives the same tokens and log-probs as a miss (hybrid GDN model included),
hits are counted, and cached blocks are evicted, never lost, when the pool runs short."""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from ft import LLM, SamplingParams
from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.radix_cache import RadixCache
from ft.scheduler.request import Request
from ft.scheduler.scheduler import Scheduler
from ft.scheduler.state_pool import SlotAllocator
from tests.checkpoints import write_checkpoint

SHARED = [7, 3, 91, 15, 22, 8, 64, 30, 11, 2, 45, 45, 19, 5, 70, 33, 61, 4]  # 18 tokens: 4 blocks of 4 + 2
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


def run(path, prompts, **options):
    options = {"device": "cpu", "dtype": "float32", "block_size": 4, **options}
    with LLM(model=str(path), progress=False, **options) as llm:
        outs = [llm.generate([p], PARAMS)[0] for p in prompts]  # one after another: later ones can hit
        return outs, llm.engine.stats()


def assert_same(a, b, tol=5e-5):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < tol for k in x)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_moe"])
def test_hit_equals_miss(tmp_path, model_type):
    write_checkpoint(tmp_path, model_type, seed=4)
    prompts = [SHARED, SHARED, SHARED + [9, 9, 1], SHARED[:9] + [50, 51]]
    cold, cold_stats = run(tmp_path, prompts, enable_prefix_cache=False)
    warm, stats = run(tmp_path, prompts)
    for a, b in zip(warm, cold):
        assert_same(a, b)
    assert cold_stats.prefix_hit_tokens == 0
    # the repeat hits the 16 aligned tokens; the extension hits them too
    assert warm[1].num_cached_tokens == 16 and warm[2].num_cached_tokens == 16
    if model_type == "qwen3_moe":
        assert warm[3].num_cached_tokens == 8  # attention-only: any cached block boundary
    assert stats.prefix_hit_tokens == sum(o.num_cached_tokens for o in warm) >= 32


@pytest.mark.parametrize("budget", [5, 7])
def test_snapshots_inside_unaligned_chunks(tmp_path, budget):
    """Chunks of 5 or 7 tokens over 4-token blocks put the snapshot points anywhere in a chunk,
    including within the conv's 3-token history of its start (read from the slot instead)."""
    write_checkpoint(tmp_path, "qwen3_next", seed=5)
    prompts = [SHARED, SHARED + [9, 9, 1], SHARED[:13] + [50, 51]]
    cold, _ = run(tmp_path, prompts, enable_prefix_cache=False)
    warm, _ = run(tmp_path, prompts, max_num_batched_tokens=budget)
    for a, b in zip(warm, cold):
        assert_same(a, b)
    assert [o.num_cached_tokens for o in warm] == [0, 16, 12]


def test_hybrid_prompt_is_one_chunk_with_a_snapshot_inside():
    blocks, slots = BlockAllocator(64, 4), SlotAllocator(4)
    sched = Scheduler(blocks, slots, 4, 256, 256, RadixCache(4, num_snapshots=4), hybrid=True)
    sched.add(Request("a", list(range(18)), PARAMS))
    (seq,) = sched.schedule().seqs
    assert len(seq.token_ids) == 18 and seq.snapshot_to is not None and seq.snapshot_len == 16


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_generated_tokens_are_cached_for_the_next_turn(tmp_path, model_type):
    """A chat's next turn hits the tokens generated in the last one. On a hybrid model that needs
    the GDN state at a block boundary inside the generated tokens: a decode step that fills a
    block snapshots it (a request keeps its latest such snapshot only)."""
    write_checkpoint(tmp_path, model_type, seed=6)
    first, _ = run(tmp_path, [SHARED])
    turn2 = SHARED + first[0].token_ids + [12, 13]
    cold, _ = run(tmp_path, [turn2], enable_prefix_cache=False)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False, block_size=4) as llm:
        llm.generate([SHARED], PARAMS)
        cache = llm.engine.scheduler.cache
        held = sorted(n.depth for n in cache._snapshotted)
        warm = llm.generate([turn2], PARAMS)[0]
    assert warm.num_cached_tokens == 24  # 18 prompt + 7 computed generated tokens, in whole blocks
    assert_same(warm, cold[0])
    # the prompt's snapshot (block 4), then the latest decode one (block 6; block 5's dropped)
    assert held == ([4, 6] if model_type == "qwen3_next" else [])


def drive(eng, arrivals: dict, steps: int = 50) -> dict:
    """Step ``eng`` at least ``steps`` times and until every request ends, adding the requests of
    ``arrivals`` ({step: [(id, prompt, params)]}) at their steps; the outputs by request id."""
    outs, step, last = {}, 0, max(arrivals)
    while step < steps or step <= last or eng.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(prompt, params, rid)
        outs.update((o.request_id, o) for o in eng.step())
        step += 1
    return outs


def test_small_pool_evicts_cached_blocks(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next", seed=8)
    prompts = [SHARED, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], SHARED, [40] * 20]
    cold, _ = run(tmp_path, prompts, enable_prefix_cache=False)
    warm, stats = run(tmp_path, prompts, num_tokens=32, prefix_snapshot_slots=1)
    for a, b in zip(warm, cold):
        assert_same(a, b)
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_radix_cache_lru_eviction_keeps_held_blocks():
    cache = RadixCache(block_size=2, num_snapshots=1)
    a = cache.insert(cache.root, (1, 2), block=10)
    b = cache.insert(a, (3, 4), block=11)
    c = cache.insert(cache.root, (5, 6), block=12)
    assert cache.insert(cache.root, (1, 2), block=13) is a and a.ref == 2  # cached under block 10
    cache.release([a, a, b, c])
    assert [n.block for n in cache.match([1, 2, 3, 4, 9])] == [10, 11]
    cache.acquire([c])
    assert cache.evict(5) == [11, 10]  # leaves first, least recent first; c is held
    assert cache.match([1, 2]) == [] and cache.num_evictable == 0
    slot = cache.take_snapshot_slot()
    cache.attach_snapshot(c, slot)
    assert cache.take_snapshot_slot() is None  # the only snapshot belongs to a held node
    cache.release([c])
    assert cache.take_snapshot_slot() == slot and c.snapshot is None


def _walk(cache: RadixCache):
    stack, out = list(cache.root.children.values()), []
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        out.append(n)
    return out


def test_radix_cache_bookkeeping_matches_a_walk_of_the_tree():
    """Random requests over shared prefixes: after every operation the tracked eviction
    candidates, unreferenced count and snapshot holders equal what a walk of the tree finds; each
    evicted block was, when taken, the least recent unreferenced leaf (lower block on ties), and
    each snapshot slot taken back came from the least recent unreferenced holder."""
    import random

    rng, cache = random.Random(3), RadixCache(block_size=2, num_snapshots=3)
    held, next_block, evictions = [], iter(range(10**6)), 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:  # a request: hit what is cached, then add its own blocks, snapshot its last
            tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]
            path = cache.match(tokens)
            cache.acquire(path)
            parent = path[-1] if path else cache.root
            for i in range(len(path), len(tokens) // 2):
                node = cache.insert(parent, tuple(tokens[2 * i : 2 * i + 2]), next(next_block))
                if node is None:
                    break
                path.append(node)
                parent = node
            if path and path[-1].snapshot is None and rng.random() < 0.5:
                idle = [n for n in _walk(cache) if n.snapshot is not None and n.ref == 0]
                victim = min(idle, key=lambda n: (n.last_use, -n.depth), default=None)
                full = not cache._free_snapshots
                slot = cache.take_snapshot_slot()
                if full and victim is not None:  # the least recent idle one (deeper on ties) gave its slot
                    assert victim.snapshot is None and slot is not None
                if slot is not None:
                    cache.attach_snapshot(path[-1], slot)
            held.append(path)
        elif op < 0.8 and held:
            cache.release(held.pop(rng.randrange(len(held))))
        else:
            for _ in range(rng.randrange(1, 4)):
                leaves = [n for n in _walk(cache) if n.ref == 0 and not n.children]
                want = min(leaves, key=lambda n: (n.last_use, n.block)).block if leaves else None
                got = cache.evict(1)
                assert got == ([want] if leaves else [])
                evictions += bool(got)
        nodes = _walk(cache)
        assert cache._leaves == {n for n in nodes if n.ref == 0 and not n.children}
        assert cache.num_evictable == sum(n.ref == 0 for n in nodes) and cache.num_nodes == len(nodes)
        assert cache._snapshotted == {n for n in nodes if n.snapshot is not None}
        assert all(n.ref >= c.ref for n in nodes for c in n.children.values())
        slots = [n.snapshot for n in cache._snapshotted] + cache._free_snapshots
        assert sorted(slots) == [0, 1, 2]
    assert evictions > 100 and cache.num_nodes > 10


def test_request_token_slices_equal_slices_of_all_tokens():
    req = Request("a", [5, 6, 7, 8], PARAMS)
    req.output_token_ids += [9, 10, 11]
    every = req.all_token_ids
    for start in range(len(every) + 1):
        for stop in range(start, len(every) + 1):
            assert req.tokens(start, stop) == every[start:stop], (start, stop)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_recomputed_request_reports_the_cached_tokens_of_its_first_admission(hybrid):
    """Preempted and recomputed, a request hits its own blocks, generated tokens included: that is
    its own work again, not its prompt served by the cache. The tokens it reports cached (usage's
    cached_tokens) stay those of its first admission, short of its prompt, and the engine's hit count
    is their sum (a recompute once reported 32 of a 31-token prompt)."""
    from tests import scheduler_sim as sim

    sched, added, first = sim.make(Scheduler, 20, hybrid), [], {}
    add = sched.add
    sched.add = lambda req: (added.append(req), add(req))

    def each_step(t, record, state):
        for req in sched.running:
            assert first.setdefault(req.request_id, req.num_cached_tokens) == req.num_cached_tokens

    sim.run(sched, seed=0, each_step=each_step)
    assert sched.num_preemptions > 20 and sum(r.num_cached_tokens > 0 for r in added) > 5
    assert all(r.num_cached_tokens < r.prompt_len for r in added)
    assert sched.prefix_hit_tokens == sum(r.num_cached_tokens for r in added)


def test_a_recomputed_cached_block_gets_the_snapshot_it_lacked(tmp_path):
    """On a hybrid model a hit ends at a block with a GDN snapshot: B shares two cached blocks
    with A, whose one snapshot sits at its fourth, so B computes from the start and its chunk's
    snapshot (at its second block) belongs on A's cached second block, whose copy B takes in
    place of its own. C, sharing those two blocks, then hits them."""
    write_checkpoint(tmp_path, "qwen3_next", seed=9)
    prompts = [SHARED, SHARED[:9] + [50, 51], SHARED[:9] + [60, 61]]
    cold, _ = run(tmp_path, prompts, enable_prefix_cache=False)
    warm, _ = run(tmp_path, prompts)
    for a, b in zip(warm, cold):
        assert_same(a, b)
    assert [o.num_cached_tokens for o in warm] == [0, 0, 8]


def test_a_decode_snapshot_is_taken_on_every_rank(tmp_path):
    """Each tensor-parallel rank holds its share of the GDN state: the next turn's hit on the
    generated tokens restores every rank's copy (a rank without it would restore stale rows)."""
    write_checkpoint(tmp_path, "qwen3_next", seed=6)
    first, _ = run(tmp_path, [SHARED])
    turn2 = SHARED + first[0].token_ids + [12, 13]
    cold, _ = run(tmp_path, [turn2], enable_prefix_cache=False)
    warm, _ = run(tmp_path, [SHARED, turn2], tp_size=2)
    assert warm[1].num_cached_tokens == 24
    assert_same(warm[1], cold[0], tol=1e-4)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("gdn_layers", [2, 5])
def test_state_copies_take_the_same_ops_whatever_the_layer_count(tmp_path, gdn_layers):
    """A step that restores or takes a GDN snapshot copies the rows of every GDN layer: the rows
    sit in one tensor a state kind for all layers, so the copy is a few device ops (here: the
    upload of its row lists, then a gather and a scatter a stack), not two more a layer (a
    batch-1 decode step of the 80B has ~460 launches; a copy per layer added ~150)."""
    layers = ["linear_attention"] * gdn_layers + ["full_attention"]
    write_checkpoint(tmp_path, "qwen3_next", seed=6, num_hidden_layers=len(layers), layer_types=layers)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False, block_size=4) as llm:
        runner = llm.engine.executor.runner
        gdn = runner.gdn_layers
        assert len(gdn) == gdn_layers
        for i, m in enumerate(gdn):
            m.conv_state[1].fill_(i + 1)
            m.ssm_state[1].fill_(-i - 1)
        with _CountOps() as count:
            runner._copy_states([(1, 3), (1, 2)])
        assert count.ops == 9, count.ops  # 5 for the upload, 2 a stack: conv and recurrent
        for i, m in enumerate(gdn):
            assert (m.conv_state[2:4] == i + 1).all() and (m.ssm_state[2:4] == -i - 1).all()


@pytest.mark.parametrize("ahead", [False, True])
def test_a_later_twin_pins_no_decode_snapshot_on_the_blocks_it_follows(tmp_path, monkeypatch, ahead):
    """B repeats A's prompt 5 steps later and decodes A's tokens behind it (filling its blocks on
    the steps A fills none): it takes A's copies of its blocks, which A holds and whose decode
    snapshots A's keep-latest rule has dropped. B's must not go there (held while A runs, and
    the last outlives B), nor those of E0..E3, twins ending before A, so the pool's 6 slots stay
    free for C's prompt, arriving while A and B decode, and D, repeating C, hits it (B once took
    them all; then B and each E kept their latest there: C got none, D hit 0)."""
    from tests import symbolic_runner

    write_checkpoint(tmp_path, "qwen3_moe", seed=3)
    options = dict(block_size=2, num_tokens=256, max_running_requests=3, prefix_snapshot_slots=6)
    eng = symbolic_runner.engine(monkeypatch, str(tmp_path), True, decode_ahead=ahead, **options)
    twin, other = [5, 9, 2, 7, 3], [8, 8, 1, 4, 6, 2, 9]
    long, short, brief = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (60, 2, 6))
    arrivals = {0: [("a", twin, long)], 5: [("b", twin, long)], 40: [("c", other, short)]}
    arrivals.update({8 + 8 * k: [(f"e{k}", twin, brief)] for k in range(4)})  # end before A and B
    outs = drive(eng, arrivals)
    assert outs["a"].token_ids == outs["b"].token_ids and len(outs["a"].token_ids) == 60
    assert drive(eng, {0: [("d", other, short)]}, steps=0)["d"].num_cached_tokens == 6


def test_chats_sharing_an_unaligned_system_prompt_hit_it_and_their_own_turns(tmp_path):
    """Chats whose system prompt ends inside a block: the first chat snapshots only its own
    boundaries, so the second falls back to no hit. It recomputes the cached system blocks, takes
    its snapshot at the last of them (the deepest block it matched, cached without one), and
    takes the cached copies in place of its own, so its own blocks enter the cache below them:
    the third chat hits the system prompt, and every chat's next turn its generated tokens.
    Outputs equal the uncached runs."""
    write_checkpoint(tmp_path, "qwen3_next", seed=6)
    system = SHARED + [40, 41, 42, 43]  # 22 tokens: whole blocks of 4 up to 20
    users = [[50 + i, 60 + i, 70 + i, 80 + i, 90 - i] for i in range(3)]
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False, block_size=4) as llm:
        first = [llm.generate([system + u], PARAMS)[0] for u in users]
        turns = [system + u + f.token_ids + [12, 13] for u, f in zip(users, first)]
        second = [llm.generate([t], PARAMS)[0] for t in turns]
    assert [o.num_cached_tokens for o in first] == [0, 0, 20]
    # 27 prompt tokens + 7 computed generated ones: whole blocks to 32, a decode snapshot there
    assert [o.num_cached_tokens for o in second] == [32, 32, 32]
    cold, _ = run(tmp_path, [system + u for u in users] + turns, enable_prefix_cache=False)
    for got, want in zip(first + second, cold):
        assert_same(got, want)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_request_that_computed_cached_blocks_again_takes_the_cached_copies(ahead):
    """Two requests with one prompt admitted in one step both compute it. Once it is cached, the
    second's full blocks are the first's (its own go back to the pool, and the ranks' tables
    follow: ``scheduler_sim.launch`` checks them every batch), and the blocks it generates enter
    the cache below the shared ones. Nothing is held twice, nothing leaks."""
    from tests import scheduler_sim as sim

    sched, state = sim.make(Scheduler, 40, hybrid=False, budget=64), {}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a, b = (Request(rid, list(range(1, 19)), params) for rid in "ab")  # 18 tokens: 4 full blocks of 4
    sched.add(a)
    sched.add(b)
    sim.step(sched, ahead, state)  # both prompts in one batch
    assert b.block_ids[:4] == a.block_ids[:4] and b.cache_nodes == a.cache_nodes
    assert sched.blocks.num_free == 40 - 5 - 1  # a's 5 blocks, and b's fifth
    while sched.has_unfinished():
        sim.step(sched, ahead, state)
    # b decodes other tokens than a (the simulator's depend on the request): 29 computed tokens
    assert len(sched.cache.match(b.prompt_token_ids + b.output_token_ids)) == 7
    assert sched.room == 40 and sched.cache.num_evictable == sched.cache.num_nodes


def test_a_prompt_reclaims_a_running_requests_decode_snapshot(tmp_path, monkeypatch):
    """Decode snapshots take only free slots, but once attached they are held as long as their
    request runs. With two long replies holding both slots of the pool, a new prompt's snapshot
    takes one of theirs back (a prompt's is shared more): C's repeat D hits C's prompt."""
    from tests import symbolic_runner

    write_checkpoint(tmp_path, "qwen3_moe", seed=3)
    options = dict(block_size=2, num_tokens=256, max_running_requests=3, prefix_snapshot_slots=2)
    eng = symbolic_runner.engine(monkeypatch, str(tmp_path), True, **options)
    long, short = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 2))
    arrivals = {0: [("a", [5, 9], long), ("b", [4, 4], long)], 12: [("c", [8, 8, 1, 4, 6, 2, 9], short)]}
    outs, step = {}, 0
    while step < 20 or eng.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(prompt, params, rid)
        if step == 11:  # both replies hold a decode snapshot, and no slot is free
            assert eng.scheduler.cache.take_snapshot_slot(evict=False) is None
        outs.update((o.request_id, o) for o in eng.step())
        step += 1
    eng.add_request([8, 8, 1, 4, 6, 2, 9], short, "d")
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    assert outs["d"].num_cached_tokens == 6


@pytest.mark.parametrize("ahead", [False, True])
def test_a_long_twin_leaves_the_ended_twins_decode_snapshots_to_prompts(tmp_path, monkeypatch, ahead):
    """Four twins of one prompt end at different lengths, each leaving its last decode snapshot on
    the shared path; B, a longer twin behind them, holds that path while it runs. C's prompt takes
    one of those snapshots back (only B holds their blocks), so D, repeating C, hits it."""
    from tests import symbolic_runner

    write_checkpoint(tmp_path, "qwen3_moe", seed=3)
    options = dict(block_size=2, num_tokens=256, max_running_requests=3, prefix_snapshot_slots=6)
    eng = symbolic_runner.engine(monkeypatch, str(tmp_path), True, decode_ahead=ahead, **options)
    twin, other = [5, 9, 2, 7, 3], [8, 8, 1, 4, 6, 2, 9]
    lengths = (2, 6, 10, 14, 18, 60)
    params = {n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths}
    arrivals = {
        0: [("e0", twin, params[6]), ("e1", twin, params[10])],
        1: [("e2", twin, params[14])],
        2: [("e3", twin, params[18])],
        25: [("b", twin, params[60])],
        45: [("c", other, params[2])],
    }
    drive(eng, arrivals)
    assert drive(eng, {0: [("d", other, params[2])]}, steps=0)["d"].num_cached_tokens == 6
