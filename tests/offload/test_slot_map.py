"""The expert cache's slot map and eviction policies, the expert-major layout, host-memory checks,
the transfer engine and the dummy routing skew, each on its own (CPU, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ft.config import EngineConfig, parse_size
from ft.distributed import TPInfo, tp_context
from ft.models.dummy import skew_routers
from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.host_store import GiB, check_host_memory
from ft.moe.backends.layout import ExpertLayout
from ft.moe.backends.slot_map import SlotMap
from ft.moe.backends.transfer import Transfer
from ft.moe.banks import BF16ExpertBank
from ft.moe.nvfp4_bank import NVFP4ExpertBank
from ft.moe.router import TopKRouter


@pytest.fixture(autouse=True)
def one_rank():
    with tp_context(TPInfo(0, 1)):  # banks read their tensor-parallel rank when built
        yield


def ensure(m: SlotMap, experts, step=None):
    if step is not None:
        m.begin_step(step)
    return m.ensure(np.array(experts))


def test_misses_fill_empty_slots_then_hits_are_counted():
    m = SlotMap(num_experts=8, num_slots=3)
    copies = ensure(m, [1, 5], step=1)
    assert sorted(e for e, _ in copies) == [1, 5] and len({s for _, s in copies}) == 2
    assert (m.counts.hits, m.counts.misses, m.counts.evictions) == (0, 2, 0)
    m.dirty = False  # as after the device table was written
    assert ensure(m, [5, 1], step=2) == [] and m.prefetch(np.array([1])) == []
    assert (m.counts.hits, m.counts.misses) == (2, 2)
    assert not m.dirty  # nothing moved: the device table is not rewritten
    assert m.num_resident == 2 and m.resident(np.array([1, 5, 2])).tolist() == [True, True, False]


def test_lru_evicts_the_least_recently_used():
    m = SlotMap(8, 3, "lru")
    ensure(m, [0, 1, 2], step=1)
    ensure(m, [0], step=2)  # 1 is now the oldest, then 2
    ensure(m, [1], step=3)  # 2 is the oldest
    [(e, slot)] = ensure(m, [7], step=4)
    assert e == 7 and m.expert_in[slot] == 7
    assert m.resident(np.array([0, 1, 2])).tolist() == [True, True, False]
    assert m.counts.evictions == 1 and m.slot_of[2] == m.null


def test_lru_ties_go_to_the_lowest_slot():
    """After the start-up fill every slot has the same last use: the misses take the lowest
    unpinned dynamic slots, in slot order (a partition of the keys must choose as a stable sort)."""
    m = SlotMap(16, 8, "lru", static=2)
    m.warm()  # experts 2..7 in slots 2..7, all at tick 0
    ensure(m, [3], step=1)  # a hit: slot 3 is now the most recent
    copies = ensure(m, [9, 12], step=2)
    assert copies == [(9, 2), (12, 4)]


def test_lfu_keeps_the_frequent_expert_that_lru_would_evict():
    def run(policy):
        m = SlotMap(8, 2, policy)
        for step in range(1, 6):
            ensure(m, [0], step=step)  # 0 is popular
        ensure(m, [1], step=6)  # 1 is more recent than 0
        ensure(m, [2], step=7)
        return m.resident(np.array([0, 1, 2])).tolist()

    assert run("lru") == [False, True, True]
    assert run("lfu") == [True, False, True]


def test_lfu_victims_are_the_full_sort_by_frequency_then_recency():
    """LFU picks its n victims from the slots at or below the n-th lowest frequency; that is the
    full stable sort's first n (frequency, then last use, then slot), ties and all."""
    rng = np.random.default_rng(3)
    m = SlotMap(64, 48, "lfu")
    m.warm()
    for trial in range(200):
        m.freq[:] = rng.integers(0, 4, 64) / 2  # many ties
        m.last_use[:] = rng.integers(0, 5, 48)
        cand = np.sort(rng.choice(48, size=int(rng.integers(1, 49)), replace=False))
        holder = m.expert_in[cand]
        want = cand[np.lexsort((m.last_use[cand], m.freq[holder]))]
        for n in {1, min(2, len(cand)), len(cand) // 2 or 1, len(cand)}:
            assert m._victims(n, cand).tolist() == want[:n].tolist(), (trial, n)


def test_a_policy_switch_starts_the_use_counts_afresh():
    """After ``set_policy("lfu")`` the counts of the LRU phase are gone: the expert popular
    before the switch is evicted like any other, once the new phase's uses outweigh it."""
    m = SlotMap(8, 2, "lru")
    for step in range(1, 6):
        ensure(m, [0], step=step)  # 0 popular under LRU
    m.set_policy("lfu")
    assert m.policy == "lfu" and not m.freq.any()
    ensure(m, [1], step=6)
    ensure(m, [1], step=7)  # 1 now counts more than 0, which has no count left
    ensure(m, [2], step=8)
    assert m.resident(np.array([0, 1, 2])).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="expert cache policy 'mru'"):
        m.set_policy("mru")


def test_pinned_slots_are_never_evicted_mid_step():
    m = SlotMap(8, 2)
    ensure(m, [3, 4], step=1)
    assert m.prefetch(np.array([5, 6])) == []  # both slots serve this step
    assert m.resident(np.array([3, 4])).all()
    assert m.ensure(np.array([3, 4, 5])) is None  # three experts cannot fit two slots
    assert m.resident(np.array([3, 4])).all()
    m.begin_step(2)  # the next step may evict them
    copies = m.prefetch(np.array([5]))
    assert [e for e, _ in copies] == [5] and m.counts.prefetched == 1
    assert m.resident(np.array([3, 4])).sum() == 1


def test_prefetch_never_evicts_an_expert_it_asks_for_and_its_hits_are_counted():
    m = SlotMap(8, 2)
    ensure(m, [1, 2], step=1)
    m.begin_step(2)
    copies = m.prefetch(np.array([1, 6]))  # 1 is resident and asked for: 2 goes
    assert copies == [(6, int(m.slot_of[6]))] and m.resident(np.array([1, 2, 6])).tolist() == [
        True,
        False,
        True,
    ]
    ensure(m, [6], step=3)
    assert (m.counts.prefetch_hits, m.counts.hits) == (1, 1)


@pytest.mark.parametrize("bank_cls", [BF16ExpertBank, NVFP4ExpertBank])
def test_layout_views_alias_one_block_and_a_row_is_one_expert(bank_cls):
    with torch.device("meta"):
        bank = bank_cls(6, 32, 32, "bf16")
    layout = ExpertLayout.of(bank)
    assert layout.expert_bytes % 256 == 0 and layout.payload_bytes <= layout.expert_bytes
    block = layout.allocate(6, "cpu")
    views = layout.views(block)
    for name in bank.expert_tensors:
        assert (
            views[name].shape == getattr(bank, name).shape and views[name].dtype == getattr(bank, name).dtype
        )
        views[name][4].view(torch.uint8).fill_(7)
    assert bool((block[4] != 0).sum() == layout.payload_bytes) and not block[3].any()
    cache = layout.allocate(3, "cpu")
    Transfer(torch.device("cpu")).issue(cache, [1], block, [4])
    for name, v in layout.views(cache).items():
        assert torch.equal(v[1].view(torch.uint8), views[name][4].view(torch.uint8)), name


def test_expert_cache_table_and_null_slot():
    with torch.device("meta"):
        bank = BF16ExpertBank(8, 16, 16)
    layout = ExpertLayout.of(bank)
    cache = ExpertCache(layout, SlotMap(8, 2), torch.device("cpu"))
    assert cache.table.tolist() == [2] * 8 and not cache.block[2].any()
    ensure(cache.map, [3, 6], step=1)
    cache.publish()
    ids = torch.tensor([[3, 6], [6, 0]])
    slots = cache.slot_ids(ids)
    assert slots[0].tolist() == [cache.map.slot_of[3], cache.map.slot_of[6]] and slots[1, 1] == 2


def test_transfer_coalesces_runs_and_counts_bytes():
    src = torch.arange(5 * 256, dtype=torch.int64).to(torch.uint8).view(5, 256)
    dst = torch.zeros(4, 256, dtype=torch.uint8)
    tr = Transfer(torch.device("cpu"))
    tr.issue(dst, [0, 1, 3], src, [2, 3, 0])
    assert torch.equal(dst[0], src[2]) and torch.equal(dst[1], src[3]) and torch.equal(dst[3], src[0])
    assert tr.counts.h2d_bytes == 3 * 256 and tr.counts.h2d_copies == 3
    tr.issue(dst, [2], dst, [0], h2d=False)
    assert tr.counts.d2d_bytes == 256 and torch.equal(dst[2], src[2])


def test_transfer_spans_are_the_bytes_the_row_slices_cover():
    """``transfer.spans`` (the addresses ``MEMCPY`` hands cudaMemcpyAsync): moving each span's bytes
    with a plain memmove gives what ``copy_`` of the row slices gives, blocks of another dtype too."""
    import ctypes

    from ft.moe.backends.transfer import _runs, rows_alike, spans

    src = torch.randint(-(2**62), 2**62, (9, 32), dtype=torch.int64)  # rows of 256 bytes
    want, got = torch.zeros(6, 256, dtype=torch.uint8), torch.zeros(6, 256, dtype=torch.uint8)
    runs = _runs([0, 1, 2, 5], [4, 5, 6, 0])
    assert runs == [(0, 4, 3), (5, 0, 1)] and rows_alike(got, src)
    for d, s, n in runs:
        want[d : d + n].copy_(src[s : s + n].view(torch.uint8))
    for dst_ptr, src_ptr, nbytes in spans(got, src, runs):
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
    assert torch.equal(got, want) and not torch.equal(got, torch.zeros_like(got))
    assert not rows_alike(got, src[:, :16]) and not rows_alike(got[:, ::2], src[:, :16])
    assert not rows_alike(got.view(-1), src)


def test_host_memory_check_refuses_with_the_figures():
    check_host_memory(GiB, 2, limit=64 * GiB)
    with pytest.raises(MemoryError, match=r"need 40\.00 GiB.*20\.00 GiB on each of 2 rank.*32\.00 GiB"):
        check_host_memory(20 * GiB, 2, limit=32 * GiB)


def test_sizes_and_config_checks():
    assert parse_size("48GiB") == 48 << 30 and parse_size("500MB") == 500 * 10**6 and parse_size(7) == 7
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")
    assert parse_size("4096B") == 4096 and parse_size("1.5k") == 1500 and parse_size("2 GiB") == 2 << 30
    for bare in ("48", "48ib", " 1.5 "):  # no unit: not taken as bytes
        with pytest.raises(ValueError, match="with a unit"):
            parse_size(bare)
    cfg = EngineConfig(config_file="x", load_format="dummy", device="cuda", max_gpu_memory="48GiB")
    assert cfg.max_gpu_memory_bytes == 48 << 30
    bad_options = (
        dict(moe_backend="disk"),
        dict(expert_cache_policy="fifo"),
        dict(expert_cache_fraction=0.0),
        dict(static_experts=-1),
    )
    for bad in bad_options:
        with pytest.raises(ValueError):
            EngineConfig(config_file="x", load_format="dummy", **bad)


def test_routing_skew_concentrates_the_selections():
    torch.manual_seed(0)
    x = torch.randn(2000, 64)

    def top_share(skew: float) -> float:
        r = TopKRouter(64, 64, 4, True)
        torch.nn.init.normal_(r.weight, std=64**-0.5)
        if skew:
            skew_routers(r, skew, seed=0)
        counts = torch.bincount(r(x)[1].flatten(), minlength=64).sort(descending=True).values
        return float(counts[:6].sum() / counts.sum())  # the top ~10% of experts

    uniform, skewed = top_share(0.0), top_share(1.0)
    assert uniform < 0.2 and skewed > 1.5 * uniform, (uniform, skewed)


def test_static_slots_are_resident_hits_and_never_evicted():
    m = SlotMap(num_experts=8, num_slots=4, policy="lfu", static=2)  # experts 0, 1 in slots 0, 1
    assert m.slot_of[:2].tolist() == [0, 1] and m.num_resident == 2 and m.num_dynamic == 2
    assert m.fits(np.array([0, 1, 5, 6])) and not m.fits(np.array([0, 5, 6, 7]))
    for step, experts in enumerate([[5, 6], [6, 7], [2, 3], [4, 5], [3, 7]], start=1):
        for e, slot in ensure(m, experts, step=step):
            assert e >= 2 and slot >= 2  # only dynamic slots are filled
    m.begin_step(6)
    assert sorted(e for e, _ in m.prefetch(np.array([0, 2, 4]))) == [2, 4] and m.counts.evictions > 0
    m.begin_step(7)
    assert ensure(m, [0, 1, 3]) is not None  # both static experts hit, 3 takes a dynamic slot
    assert m.slot_of[:2].tolist() == [0, 1] and m.expert_in[:2].tolist() == [0, 1]
    assert m.counts.hits >= 2 and m.num_resident == 4
    with pytest.raises(ValueError, match="static experts: 4 must leave a dynamic slot"):
        SlotMap(8, 4, static=4)


def test_expert_cache_table_starts_with_the_static_experts():
    with torch.device("meta"):
        bank = BF16ExpertBank(8, 16, 16)
    cache = ExpertCache(ExpertLayout.of(bank), SlotMap(8, 4, static=3), torch.device("cpu"))
    assert cache.table.tolist() == [0, 1, 2, 4, 4, 4, 4, 4]  # 4: the null slot
    cache.map.slot_of[5] = 3  # the table is a copy: it changes only when published
    assert cache.table[5] == 4


def test_warm_fills_the_empty_dynamic_slots_without_counting_uses():
    m = SlotMap(num_experts=8, num_slots=5, static=2)
    ensure(m, [6], step=1)  # one dynamic slot taken by a use
    copies = m.warm()
    assert [e for e, _ in copies] == [2, 3] and sorted(s for _, s in copies) == [3, 4]
    assert m.num_resident == 5 and m.warm() == []
    assert (m.counts.hits, m.counts.misses, m.counts.prefetched, m.counts.evictions) == (0, 1, 0, 0)
    assert m.resident(np.array([0, 1, 2, 3, 6])).all() and not m.resident(np.array([4, 5, 7])).any()


def test_restart_returns_to_the_start_up_fill_and_forgets_the_uses():
    m = SlotMap(16, 8, "lfu", static=2)
    m.begin_step(0)
    start = (m.warm(), m.slot_of.copy(), m.expert_in.copy())
    for step in range(1, 6):
        m.begin_step(step)
        m.ensure(np.array([9, 11, 13, step + 8]))
    assert not np.array_equal(m.slot_of, start[1]) and m.freq.any()
    copies = m.restart()
    assert np.array_equal(m.slot_of, start[1]) and np.array_equal(m.expert_in, start[2])
    assert copies == start[0] and not m.freq.any() and (m.pin_step == -1).all()
