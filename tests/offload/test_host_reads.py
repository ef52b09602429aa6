"""Host reads (``ft.moe.backends.host_reads``): decode batches whose MoE kernel reads the missed
experts from the host store in place give exactly the resident backend's outputs, and between
steps the cache takes in some of the misses, publishing a slot only once its copy has landed.

On a CPU the kernel "reading both sides" is the CPU reference on the slots and the host store
stacked into one bank (``as_one_bank``): what runs is the route table, the use counts, the
promotions and their publication, the logic a GPU runs too (its kernel: the MoE GEMV's host
rows, tests/test_moe_fusions_interp.py and tests/offload/test_offload_gpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ft.forward_context import ForwardBatch, ForwardContext, forward_context
from ft.moe.backends import host_reads
from ft.moe.backends.expert_cache import ExpertCache, Tables
from ft.moe.backends.host_reads import as_one_bank
from ft.moe.backends.layout import ExpertLayout, Part
from ft.moe.backends.runtime import moe_blocks
from ft.moe.backends.slot_map import SlotMap
from ft.moe.backends.transfer import Transfer, _runs
from tests.offload.equality import PARAMS, PROMPTS, assert_same, engine, generate


@pytest.fixture(params=[False, True], ids=["at-once", "deferred"])
def reads_on(monkeypatch, request):
    """Host reads on, the between-step work done at once or a step late (``DEFERRED``)."""
    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_reads, "DEFERRED", request.param)


@pytest.mark.parametrize("fraction", [0.125, 0.5])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_host_reads_equal_resident(ckpt, refs, reads_on, monkeypatch, fraction, policy):
    """Every miss promoted (the cache changes at every step) or the default share."""
    for share in (1.0, host_reads.PROMOTE_SHARE):
        monkeypatch.setattr(host_reads, "PROMOTE_SHARE", share)
        outs, s = generate(
            ckpt, moe_backend="offload", expert_cache_fraction=fraction, expert_cache_policy=policy
        )
        assert_same(outs, refs[8192])
        assert s.moe_bytes_host_read > 0 and s.moe_misses > 0 and s.moe_tokens > 0
        if share == 1.0 and policy == "lru":  # promoted misses evicted what was there
            assert s.moe_evictions > 0


def test_host_reads_with_chunked_prefill_and_all_experts_resident(ckpt, refs, reads_on):
    outs, _ = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25, max_num_batched_tokens=5)
    assert_same(outs, refs[5])
    outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=1.0)
    assert_same(outs, refs[8192])
    assert s.moe_bytes_host_read == 0 and s.moe_misses == 0 and s.moe_hits > 0


def test_host_reads_with_a_lean_store(ckpt, refs, reads_on):
    """Static experts (no host copy) in their slots, the others read from the host rows e - R."""
    outs, s = generate(ckpt, moe_backend="offload", static_experts=2, expert_cache_fraction=0.5)
    assert_same(outs, refs[8192])
    assert s.moe_bytes_host_read > 0 and s.moe_resident >= 2 * s.moe_layers


def test_only_batches_host_reads_take_publish_every_layers_routes(ckpt, refs, reads_on, monkeypatch):
    """``MoeRuntime.before_step`` uploads every layer's routes before a batch host reads may take,
    and not before a prefill or a copying decode batch (those read each layer's own table)."""
    from ft.moe.backends.runtime import MoeRuntime

    monkeypatch.setattr(host_reads, "CPU_MAX_TOKENS", 2)  # the three prompts' first decode batch copies
    published, publish = [], Tables.publish
    monkeypatch.setattr(Tables, "publish", lambda tables: (published.append(1), publish(tables))[1])
    steps, before = [], MoeRuntime.before_step

    def spy(runtime, tokens):
        n = len(published)
        before(runtime, tokens)
        steps.append((tokens, len(published) > n))

    monkeypatch.setattr(MoeRuntime, "before_step", spy)
    outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.5)
    assert_same(outs, refs[8192])
    assert s.moe_bytes_host_read > 0 and s.moe_bytes_h2d > 0
    assert {t for t, p in steps if p} == {1, 2} and all(p for t, p in steps if t <= 2)
    assert {3} < {t for t, p in steps if not p} and max(t for t, _ in steps) > 3  # copying decode, prefill


def test_without_the_switch_decode_copies_its_misses(ckpt, refs, copying_decode):
    outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
    assert_same(outs, refs[8192])
    assert s.moe_bytes_host_read == 0 and s.moe_bytes_h2d > 0


def test_promote_takes_the_most_used_misses_into_slots_the_step_did_not_use():
    m = SlotMap(num_experts=8, num_slots=3)
    m.begin_step(1)
    m.warm()  # experts 0, 1, 2 in slots 0, 1, 2
    hit = m.classify(np.array([0, 5, 6, 7]))  # 0 hits (pinned for this step), 5, 6, 7 miss
    assert hit.tolist() == [True, False, False, False]
    m.freq[7] += 3.0  # used more than 5 and 6
    copies = m.promote(np.array([5, 6, 7]), 1)
    assert len(copies) == 1 and copies[0][0] == 7 and copies[0][1] in (1, 2)  # never 0's slot
    assert m.promote(np.array([5, 6]), 0) == []
    assert len(m.promote(np.array([5, 6]), 5)) == 1  # one unpinned slot left this step


def test_promote_never_gives_an_expert_a_second_slot():
    """An expert whose copy is still in flight counts as a miss of the step that read it from the
    host; promoting it again would put it in two slots, and evicting either later would drop it."""
    m = SlotMap(num_experts=8, num_slots=3)
    m.begin_step(1)
    m.warm()  # experts 0, 1, 2
    copies = m.promote(np.array([1, 5]), 2)
    assert [e for e, _ in copies] == [5]
    held = m.expert_in[m.expert_in >= 0]
    assert len(set(held.tolist())) == len(held)


def test_a_step_is_counted_as_it_read_its_experts():
    """Deferred host reads count a step after later promotions moved its experts: expert 0, read
    from slot 0 and evicted since, is still that step's hit (no host bytes, no promotion back);
    expert 5, read from the host and promoted since, its miss."""
    m = SlotMap(num_experts=8, num_slots=3)
    m.begin_step(1)
    m.warm()  # experts 0, 1, 2
    read = np.array([0, -6])  # as the step's route sent experts 0 and 5
    m.begin_step(2)
    assert m.promote(np.array([5]), 1)[0][1] == 0  # 0's slot, the least recently used, goes to 5
    m.begin_step(3)
    hit = m.classify(np.array([0, 5]), read)
    assert hit.tolist() == [True, False] and (m.counts.hits, m.counts.misses) == (1, 1)
    assert m.pin_step[0] != 3  # slot 0 holds 5 now: nothing of the counted step is pinned there


def test_lfu_promotes_only_over_a_less_used_expert():
    m = SlotMap(num_experts=8, num_slots=2, policy="lfu")
    m.begin_step(1)
    m.warm()  # experts 0, 1
    m.freq[:] = [5.0, 0.5, 0, 0, 1.0, 0, 0, 0]
    copies = m.promote(np.array([4, 3]), 2)  # 4 (1.0) beats 1 (0.5); 3 (0.0) beats nobody
    assert copies == [(4, 1)]


class Landing:
    """A copy's event, landed when told."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_route_points_at_a_slot_only_once_its_copy_landed():
    layout = ExpertLayout((Part("w", (2,), torch.float32, 0),), 256)
    m = SlotMap(num_experts=6, num_slots=3, static=1)  # expert 0 lives in slot 0 only
    m.warm()  # experts 1, 2 in slots 1, 2
    cache = ExpertCache(layout, m, torch.device("cpu"))
    tables = Tables([cache], torch.device("cpu"))
    assert cache.route.tolist() == [0, 1, 2, -3, -4, -5]  # host rows: expert e at e - 1
    m.begin_step(1)
    copies = m.promote(np.array([4]), 1)
    ((expert, slot),) = copies
    landing = Landing()
    cache.filling([slot], landing)  # as copy_in does, before the route is published
    tables.publish()
    stays = 3 - slot  # the expert in the other dynamic slot
    assert cache.route[4] == -4 and cache.route[slot] == -slot and cache.route[stays] == stays
    assert (cache.published()[[4, slot, stays]] >= 0).tolist() == [False, False, True]
    tables.publish()  # nothing landed: nothing changes
    assert cache.route[4] == -4 and cache.copying
    landing.done = True
    cache.publish()  # a layer's own publish (the copying path) writes its rows alike
    assert cache.route[4] == slot and cache.published()[4] == slot and not cache.copying


def test_tables_publish_every_layer_in_one_copy_consistent_with_a_layers_own():
    """One layer published alone (the copying path, mid-step), then all at once: every layer's
    device rows are its map's, and the all-at-once publish is one write of the stacked tensor."""
    layout = ExpertLayout((Part("w", (2,), torch.float32, 0),), 256)
    maps = [SlotMap(num_experts=6, num_slots=3) for _ in range(3)]
    caches = [ExpertCache(layout, m, torch.device("cpu")) for m in maps]
    tables = Tables(caches, torch.device("cpu"))
    writes = []
    real = tables._upload
    tables._upload = lambda dst, values: (writes.append(values.shape), real(dst, values))
    for i, m in enumerate(maps):
        m.begin_step(1)
        m.ensure(np.array([i, i + 1, 5]))
    caches[1].publish()  # its own rows first
    assert caches[1].table.tolist() == maps[1].slot_of.tolist()
    tables.publish()
    assert writes == [(3, 2, 6)]
    for c, m in zip(caches, maps):
        assert c.table.tolist() == m.slot_of.tolist() and c.route.tolist() == c.published().tolist()
        assert (c.published() >= 0).tolist() == (m.slot_of != m.null).tolist()
    tables.publish()  # nothing changed: no write
    assert writes == [(3, 2, 6)]


def test_issue_many_copies_every_job_and_counts_them_once():
    src_a = torch.arange(4 * 256, dtype=torch.int64).to(torch.uint8).view(4, 256)
    src_b = src_a.flip(0).clone()
    dst_a, dst_b = torch.zeros(3, 256, dtype=torch.uint8), torch.zeros(3, 256, dtype=torch.uint8)
    tr = Transfer(torch.device("cpu"))
    assert tr.issue_many([(dst_a, [], src_a, [])]) is None and tr.counts.h2d_copies == 0
    tr.issue_many([(dst_a, [0, 2], src_a, [3, 1]), (dst_b, [1], src_b, [0]), (dst_b, [], src_b, [])])
    assert torch.equal(dst_a[0], src_a[3]) and torch.equal(dst_a[2], src_a[1]) and not dst_a[1].any()
    assert torch.equal(dst_b[1], src_b[0]) and not dst_b[0].any()
    assert tr.counts.h2d_copies == 3 and tr.counts.h2d_bytes == 3 * 256


def test_as_one_bank_moves_host_rows_past_the_slots():
    slots, host = torch.arange(3.0)[:, None], 10 + torch.arange(4.0)[:, None]
    w13, w2, ids = as_one_bank((slots, slots), (host, host), torch.tensor([[2, -1], [-4, 0]]))
    assert w13[ids].squeeze(-1).tolist() == [[2.0, 10.0], [13.0, 0.0]]


class LateCopies:
    """Side-stream copies on a CPU that land late, as they may on a GPU: a copy's bytes arrive
    when the main stream waits for it (``Transfer.wait``) or ``late`` engine steps after it was
    issued (``step``, counted between steps), in the order issued; a reader that did neither
    reads the slot's old bytes. ``held_back``: how often a publish found a copy not yet landed
    (its expert then routed to the host)."""

    def __init__(self, late: int) -> None:
        self.late, self.pending = late, []  # [(event, destination rows, source bytes)]
        self.step = self.held_back = 0

    def issue_many(self, transfer, jobs, after=None, h2d=True):
        jobs = [j for j in jobs if j[1]]
        if not jobs:
            return None
        event = LateEvent(self)
        for dst, dst_rows, src, src_rows in jobs:
            for d, s, n in _runs(dst_rows, src_rows):
                self.pending.append((event, dst[d : d + n], src[s : s + n].clone()))
            transfer._count(h2d, len(dst_rows) * dst.shape[1], len(dst_rows), 0.0)
        return event

    def wait(self, transfer, event=None) -> None:
        self.land(event)

    def land(self, event=None) -> None:
        last = max((i for i, p in enumerate(self.pending) if p[0] is event), default=-1)
        upto = len(self.pending) if event is None else last + 1
        for ev, dst, src in self.pending[:upto]:
            dst.copy_(src)
            ev.landed = True
        del self.pending[:upto]


class LateEvent:
    def __init__(self, copies: LateCopies) -> None:
        self.copies, self.issued, self.landed = copies, copies.step, False

    def query(self) -> bool:
        if not self.landed and self.copies.step - self.issued >= self.copies.late:
            self.copies.land(self)
        self.copies.held_back += not self.landed
        return self.landed


@pytest.mark.parametrize("late", [1, 3])
def test_copies_landing_late_are_read_only_once_landed(ckpt, refs, reads_on, monkeypatch, late):
    """Promotions whose copies land steps later, and steps of both paths (host reads for batches
    of up to 2 sequences, copying for 3): the route never sends a kernel to a slot being filled,
    and an expert being copied in is not promoted into a second slot."""
    copies = LateCopies(late)
    monkeypatch.setattr(Transfer, "issue_many", lambda tr, *a, **k: copies.issue_many(tr, *a, **k))
    monkeypatch.setattr(Transfer, "wait", lambda tr, event=None: copies.wait(tr, event))
    after_step = host_reads.HostReads.after_step

    def counted(reads):
        copies.step += 1
        return after_step(reads)

    monkeypatch.setattr(host_reads.HostReads, "after_step", counted)
    monkeypatch.setattr(host_reads, "PROMOTE_SHARE", 1.0)
    monkeypatch.setattr(host_reads, "CPU_MAX_TOKENS", 2)
    for fraction in (0.5, 0.75):
        outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=fraction)
        assert_same(outs, refs[8192])
        assert s.moe_bytes_host_read > 0 and s.moe_evictions > 0
    assert copies.held_back > 0  # some newcomer was read from the host while its slot filled


def decode_batch(slots: list[int]) -> ForwardContext:
    t = len(slots)
    zeros = torch.zeros(t, dtype=torch.int32)
    batch = ForwardBatch(
        positions=torch.zeros(t, dtype=torch.long), cu_seqlens=torch.arange(t + 1, dtype=torch.int32),
        context_lens=zeros, seq_lens=zeros + 1, block_tables=torch.zeros(t, 1, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), state_slots=torch.zeros(t, dtype=torch.long),
        prev_token_ids=torch.full((t, 1), -1), block_size=16, query_lens_cpu=[1] * t,
        context_lens_cpu=[0] * t,
    )  # fmt: skip
    return ForwardContext(batch, None, None)


def test_padding_rows_read_the_null_slot_and_count_no_use(ckpt, reads_on):
    """A graphed batch padded to its graph size (KV slot -1): the padding row reads the zero null
    slot, not the host store, and its experts count as no use; the real row is unchanged."""
    with engine(ckpt, moe_backend="offload", expert_cache_fraction=0.25) as llm:
        runner = llm.engine.executor.runner
        block, backend = moe_blocks(runner.model)[0], runner.moe.backends[0]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, block.experts.hidden_size, generator=gen)
        weights, ids = torch.rand(2, 2, generator=gen), torch.tensor([[3, 5], [6, 7]])
        runner.moe.discard_uses()
        with forward_context(decode_batch([40, 41])):
            both = backend(block.experts, x, weights, ids)
        assert int(backend.uses.sum()) == 4
        runner.moe.discard_uses()
        with forward_context(decode_batch([40, -1])):
            padded = backend(block.experts, x, weights, ids)
        assert backend.uses[[6, 7]].tolist() == [0, 0] and int(backend.uses.sum()) == 2
    assert torch.equal(padded[0], both[0]) and not padded[1].any() and both[1].any()


def test_deferred_counting_counts_every_step_once_the_engine_is_idle(ckpt, monkeypatch):
    """The last step a deferred run queued is counted when the engine goes idle (its statistics
    are read): every expert use of the run counted, as when each step is counted at once."""
    monkeypatch.setattr(host_reads, "ENABLED", True)
    uses = {}
    for deferred in (False, True):
        monkeypatch.setattr(host_reads, "DEFERRED", deferred)
        _, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
        uses[deferred] = s.moe_hits + s.moe_misses
        assert s.moe_bytes_host_read > 0
    assert uses[True] == uses[False]
    with engine(ckpt, moe_backend="offload", expert_cache_fraction=0.25) as llm:  # deferred
        llm.generate(PROMPTS, PARAMS)
        first = llm.engine.stats()
        again = llm.engine.stats()  # idle again: nothing more to count
        llm.generate(PROMPTS, PARAMS)
        second = llm.engine.stats()
    assert first.moe_hits + first.moe_misses == again.moe_hits + again.moe_misses == uses[False]
    assert second.moe_hits + second.moe_misses == 2 * uses[False]


def test_stacked_maps_classify_a_step_as_each_layers_own_call():
    """``StackedMaps.classify_step`` leaves every map exactly as ``SlotMap.classify(used,
    routes[used])`` layer by layer would (pins, recency, decayed counts, prefetch marks, counts),
    over steps with promotions and prefetches between them."""
    from ft.moe.backends.slot_map import StackedMaps

    rng = np.random.default_rng(3)
    e, s, layers = 16, 6, 3

    def build():
        maps = [SlotMap(e, s, policy="lfu", static=1) for _ in range(layers)]
        for m in maps:
            m.begin_step(1)
            m.warm()
        return maps

    mine, ref = build(), build()
    stacked = StackedMaps(mine)
    for step in range(2, 30):
        uses = np.zeros((layers, e), dtype=np.int32)
        for i in range(layers):
            uses[i, rng.choice(e, 4, replace=False)] = rng.integers(1, 3, 4)
        # the routes the step read: a slot, or the host; some stale (evicted since)
        routes = np.stack([np.where(m.slot_of != m.null, m.slot_of, -1) for m in ref])
        routes[rng.random(routes.shape) < 0.1] = -1
        for maps in (mine, ref):
            for m in maps:
                m.begin_step(step)
        used, hit = stacked.classify_step(uses, routes)
        for i, m in enumerate(ref):
            experts = np.flatnonzero(uses[i])
            assert hit[i, experts].tolist() == m.classify(experts, routes[i][experts]).tolist()
        assert used.tolist() == (uses > 0).tolist()
        for a, b in zip(mine, ref):  # the same promotions and prefetches on both, then compare
            missed = np.flatnonzero((uses[mine.index(a)] > 0) & ~hit[mine.index(a)])
            assert a.promote(missed, 1) == b.promote(missed, 1)
            predicted = rng.choice(e, 2, replace=False)
            assert a.prefetch(predicted) == b.prefetch(predicted)
            for name in StackedMaps.ARRAYS:
                assert np.array_equal(getattr(a, name), getattr(b, name)), (step, name)
            assert (a.tick, a.counts) == (b.tick, b.counts)
    assert mine[0].slot_of.base is stacked.slot_of  # the maps still view the stacked rows


def test_route_and_count_routes_real_rows_and_counts_their_pairs():
    """The torch version (what a CPU runs, and the fused kernel's oracle) on a hand-worked case:
    padding rows read the null slot and count nothing; a pair's use is counted once."""
    route = torch.tensor([2, -1, 0, -2, 1])  # experts 1 and 3 on the host
    ids = torch.tensor([[1, 3], [0, 1], [4, 2]])
    uses = torch.zeros(5 + 2, dtype=torch.int32)  # two spare columns, left alone
    rows = host_reads.route_and_count(ids, torch.tensor([True, True, False]), route, 3, uses)
    assert rows.tolist() == [[-1, -2], [2, -1], [3, 3]]
    assert uses.tolist() == [1, 2, 0, 1, 0, 0, 0]


def check_route_kernel() -> None:
    """``_route_and_count_kernel`` (interpreted) against the torch version, random cases."""
    from ft.moe.backends.host_reads import _route_and_count_kernel, route_and_count

    g = torch.Generator().manual_seed(0)
    for t, k, e in ((1, 10, 512), (3, 10, 512), (8, 2, 16), (5, 4, 60)):
        route = torch.where(torch.rand(e, generator=g) < 0.3, -(torch.arange(e) + 1), torch.arange(e) % 7)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        real = torch.rand(t, generator=g) < 0.7
        want_uses, uses = torch.zeros(e + 3, dtype=torch.int32), torch.zeros(e + 3, dtype=torch.int32)
        want = route_and_count(ids, real, route, 7, want_uses)
        rows = torch.empty_like(want)
        _route_and_count_kernel[(1,)](ids, real, route, rows, uses, 7, t * k, K=k, BLOCK=128)
        assert torch.equal(rows, want) and torch.equal(uses, want_uses), (t, k, e)


@pytest.mark.skipif(host_reads.triton is None, reason="needs triton")
@pytest.mark.slow
def test_route_kernel_under_the_interpreter():
    from tests.interpreter import run_check

    run_check("tests.offload.test_host_reads", "check_route_kernel")


def test_host_reads_take_batches_up_to_their_formats_limit(monkeypatch):
    """On a GPU, a batch the bank's MoE GEMV takes and no larger than its format's
    ``MAX_TOKENS`` (the NVFP4 GEMV takes up to 16 tokens, host reads 2 of them); without one,
    ``CPU_MAX_TOKENS``."""

    class Bank:
        def __init__(self, fmt: str, gemv: int) -> None:
            self.format, self.gemv = fmt, gemv

        def takes_gemv(self, tokens: int) -> bool:
            return 0 < tokens <= self.gemv

    monkeypatch.setattr(host_reads, "MAX_TOKENS", {"bf16": 4, "nvfp4": 2})
    take = host_reads.HostReads.max_tokens
    assert take(Bank("nvfp4", 16), cuda=True) == 2 and take(Bank("bf16", 4), cuda=True) == 4
    assert take(Bank("bf16", 2), cuda=True) == 2  # never past the GEMV's own
    assert take(Bank("fp8", 16), cuda=True) == 0  # a format without a limit: none
    assert take(Bank("nvfp4", 16), cuda=False) == host_reads.CPU_MAX_TOKENS
