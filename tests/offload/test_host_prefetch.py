"""Host reads' prefetch (``ft.moe.backends.host_prefetch``): a layer's predicted host experts (its
router on the residual stream before its mixer) copied into spare cache rows on the device. The
choice and the copy against hand-worked cases, an engine with it on against the resident backend
(exact, fp32), and its statistics; the GPU kernels against the torch versions under Triton's
interpreter (``check_kernels``)."""

from __future__ import annotations

import pytest
import torch

from ft.moe.backends import host_prefetch, host_reads
from ft.moe.backends.host_prefetch import copy_rows, select
from tests.interpreter import INTERPRETER, run_check
from tests.offload.equality import assert_same, generate

ROUTE = torch.tensor([0, -1, 1, -2, -3, 2, -4, -5])  # experts 1, 3, 4, 6, 7 on the host (rows 0..4)


def test_select_takes_host_experts_by_rank_distinct_and_skips_padding():
    pred = torch.tensor([[3, 0, 7], [4, 3, 1], [6, 6, 6]])  # token 2 pads the batch
    real = torch.tensor([True, True, False])
    src, eff, picks = select(pred, real, ROUTE, rows=3, first_row=4)
    # first choices 3 (token 0) and 4 (token 1), then the second choices: 0 resident, 3 taken
    assert picks.tolist() == [4, 5, 8]  # experts 3, 4, 7 (+ 1): 7 is token 0's third choice
    assert src.tolist() == [1, 2, 4]  # their host rows
    assert eff.tolist() == [0, -1, 1, 4, 5, 2, -4, 6]  # the picks through rows 4, 5, 6; 1 not picked
    src, eff, picks = select(pred[:1], real[:1], ROUTE, rows=3, first_row=4)
    assert picks.tolist() == [4, 8, 0] and src.tolist() == [1, 4, -1]  # two host experts for three rows
    assert eff.tolist() == [0, -1, 1, 4, -3, 2, -4, 5]


def test_copy_rows_fills_only_the_picked_rows():
    src_block = torch.arange(5 * 8, dtype=torch.uint8).view(5, 8)
    dst = torch.zeros(7, 8, dtype=torch.uint8)
    copy_rows(src_block, dst, 4, torch.tensor([3, -1, 0]))
    assert torch.equal(dst[4], src_block[3]) and torch.equal(dst[6], src_block[0])
    assert not dst[:4].any() and not dst[5].any()


def test_copy_rows_from_a_byte_on_leaves_the_rows_start():
    """A down-only copy (``first``: the down projection's offset) moves each row's tail alone."""
    src_block = torch.arange(3 * 24, dtype=torch.uint8).view(3, 24)
    dst = torch.zeros(4, 24, dtype=torch.uint8)
    copy_rows(src_block, dst, 2, torch.tensor([1, 2]), first=16)
    assert torch.equal(dst[2, 16:], src_block[1, 16:]) and torch.equal(dst[3, 16:], src_block[2, 16:])
    assert not dst[:, :16].any() and not dst[:2].any()
    with pytest.raises(AssertionError, match="whole word"):
        copy_rows(src_block, dst, 2, torch.tensor([1, 2]), first=4)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_the_down_part_of_a_row_is_its_w2_parts(fmt):
    from ft.distributed import TPInfo, tp_context
    from ft.moe.backends.layout import ExpertLayout
    from ft.moe.banks import BF16ExpertBank
    from ft.moe.nvfp4_bank import NVFP4ExpertBank

    with torch.device("meta"), tp_context(TPInfo(0, 1)):
        bank = (BF16ExpertBank if fmt == "bf16" else NVFP4ExpertBank)(4, 64, 32)
    layout = ExpertLayout.of(bank)
    w2 = [p for p in layout.parts if p.name.startswith("w2")]
    assert host_prefetch.down_offset(layout) == w2[0].offset > 0
    assert host_prefetch.down_payload(layout) == sum(p.nbytes for p in w2) < layout.payload_bytes
    assert all(p.offset < w2[0].offset for p in layout.parts if not p.name.startswith("w2"))


def test_one_bank_with_down_ids_reads_each_rows_down_projection_from_them():
    """The CPU reference of host reads with a down-only prefetch: gate/up rows by ``ids``, each
    such row's down projection from the row ``down_ids`` names, host ids (e < 0) past the slots."""
    from ft.moe.backends.host_reads import as_one_bank

    def bank(first, n, width):
        return first + torch.arange(float(n))[:, None, None].expand(n, 2, width)

    slots, host = (bank(0, 4, 2), bank(10, 4, 1)), (bank(100, 2, 2), bank(200, 2, 1))
    ids = torch.tensor([[0, -2], [-1, 2]])
    w13, w2, rows = as_one_bank(slots, host, ids, torch.tensor([[0, 3], [-1, 2]]))
    assert rows.tolist() == [[0, 5], [4, 2]]  # the host rows past the four slots
    assert torch.equal(w13, torch.cat([slots[0], host[0]]))
    assert w2[:, 0, 0].tolist() == [10, 11, 12, 13, 200, 13]  # row 5 (host row 1) reads slot 3's
    w13, w2, same = as_one_bank(slots, host, ids)
    assert torch.equal(same, rows) and torch.equal(w2, torch.cat([slots[1], host[1]]))


@pytest.fixture
def prefetching(monkeypatch):
    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_prefetch, "ROWS", 2)


@pytest.mark.parametrize("down_only", [True, False])
@pytest.mark.parametrize("deferred", [False, True])
def test_host_reads_with_prefetch_equal_resident(ckpt, refs, prefetching, monkeypatch, deferred, down_only):
    """Exactly the resident backend's outputs, whole experts copied or their down projections
    alone; the picks are counted (some of them used) and the bytes over PCIe are the copies plus
    what the kernel still read from the host."""
    monkeypatch.setattr(host_reads, "DEFERRED", deferred)
    monkeypatch.setattr(host_prefetch, "DOWN_ONLY", down_only)
    outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
    assert_same(outs, refs[8192])
    assert s.moe_prefetched > 0 and 0 < s.moe_prefetch_hits <= s.moe_prefetched
    assert s.moe_bytes_host_read > 0


def test_prefetch_off_at_the_call_leaves_the_published_route(ckpt, refs, prefetching, monkeypatch):
    """Spare rows sized, the switch off when decoding: no picks, the same outputs."""
    from ft import LLM
    from tests.offload.equality import PARAMS, PROMPTS

    with LLM(model=str(ckpt), moe_backend="offload", expert_cache_fraction=0.25, progress=False) as llm:
        monkeypatch.setattr(host_prefetch, "ROWS", 0)
        outs = llm.generate(PROMPTS, PARAMS)
        s = llm.engine.stats()
        caches = llm.engine.executor.runner.moe.caches
    assert_same(outs, refs[8192])
    assert s.moe_prefetched == 0 and all(c.spare == 2 for c in caches)


def check_kernels() -> None:
    """The select and copy kernels (interpreted) against the torch versions, random cases."""
    from ft.moe.backends.host_prefetch import _copy_rows_kernel, _select_kernel

    g = torch.Generator().manual_seed(0)
    for t, k, e, rows in ((1, 10, 512, 4), (5, 10, 512, 8), (3, 4, 60, 2), (8, 2, 16, 16)):
        route = torch.randperm(e, generator=g)
        route = torch.where(torch.rand(e, generator=g) < 0.4, -(torch.arange(e) + 1), route % (e // 2))
        pred = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        real = torch.rand(t, generator=g) < 0.8
        want = select(pred, real, route, rows, first_row=e // 2 + 1)
        eff, src = torch.empty_like(route), torch.empty(rows, dtype=torch.int64)
        picks, scratch = torch.empty(rows, dtype=torch.int32), torch.zeros(e, dtype=torch.int32)
        _select_kernel[(1,)](
            pred, real, route, eff, src, picks, scratch, t, e, e // 2 + 1,
            K=k, ROWS=rows, BLOCK_TK=1 << (t * k - 1).bit_length(), BLOCK_E=1 << (e - 1).bit_length(),
        )  # fmt: skip
        assert torch.equal(src, want[0]) and torch.equal(eff, want[1]) and torch.equal(picks, want[2]), (
            t,
            k,
            e,
        )
        assert not scratch.any()
    src_block = torch.randint(-(2**62), 2**62, (6, 40), generator=g)
    dst, want_dst = torch.zeros(9, 40, dtype=torch.int64), torch.zeros(9, 40, dtype=torch.int64)
    rows = torch.tensor([5, -1, 2])
    for first in (0, 13):  # words: a whole row, or from a down projection's offset on
        _copy_rows_kernel[(3,)](src_block, dst, rows, 6, 40, first, ROWS=3, BLOCK=16, PROGRAMS=3)
        copy_rows(src_block.view(torch.uint8), want_dst.view(torch.uint8), 6, rows, first * 8)
        assert torch.equal(dst, want_dst), first
        dst.zero_()
        want_dst.zero_()


@INTERPRETER[0]
@INTERPRETER[1]
def test_kernels_under_the_interpreter():
    run_check("tests.offload.test_host_prefetch", "check_kernels")


@pytest.mark.parametrize("down_only", [True, False])
def test_the_kernel_reads_the_picked_experts_from_the_spare_rows(
    ckpt, refs, prefetching, monkeypatch, down_only
):
    """With a copy that moves nothing (the spare rows stay zeros) the outputs change: the picks
    are read from the spare rows, not from the host store (the equality above then shows the
    copies land)."""
    monkeypatch.setattr(host_prefetch, "DOWN_ONLY", down_only)
    monkeypatch.setattr(host_prefetch, "copy_rows", lambda *args: None)
    outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
    assert s.moe_prefetch_hits > 0
    with pytest.raises(AssertionError):
        assert_same(outs, refs[8192])


@pytest.mark.parametrize("down_only", [False, True])
def test_picked_experts_count_their_copy_once_and_their_uses_not_as_host_reads(monkeypatch, down_only):
    """Between steps: a pick is copied once whether used or not; the uses of a picked miss are
    not host reads; the other misses' uses are (``HostReads._count_and_promote``). A down-only
    copy moves the down projection alone, and each use of the pick still reads its gate/up rows."""
    import numpy as np

    from ft.moe.backends.expert_cache import ExpertCache
    from ft.moe.backends.host_reads import HostReads
    from ft.moe.backends.host_store import HostStore
    from ft.moe.backends.layout import ExpertLayout, Part
    from ft.moe.backends.offload import OffloadBackend
    from ft.moe.backends.slot_map import SlotMap
    from ft.moe.backends.staging import Shared
    from ft.moe.backends.transfer import Transfer

    cpu = torch.device("cpu")
    monkeypatch.setattr(host_prefetch, "DOWN_ONLY", down_only)
    layout = ExpertLayout((Part("w13", (4,), torch.float32, 0), Part("w2", (2,), torch.float32, 16)), 256)
    maps = [SlotMap(8, 4) for _ in range(2)]
    shared = Shared(Transfer(cpu), None, False, maps)
    backends = []
    for i, m in enumerate(maps):
        m.begin_step(0)
        m.warm()  # experts 0-3 resident, 4-7 on the host
        backends.append(
            OffloadBackend(HostStore(layout, 8, pin=False), ExpertCache(layout, m, cpu, 2), shared, i == 0)
        )
    reads = HostReads(backends, top_k=2, device=cpu)
    uses = np.zeros((2, 8 + 2), dtype=np.int32)
    uses[0, [0, 1]] = 1  # layer 0: two hits
    uses[1, [0, 5, 6]] = [1, 3, 1]  # layer 1: a hit, miss 5 (three uses, picked), miss 6 (one use)
    uses[1, 8:] = [5 + 1, 7 + 1]  # its picks: 5 (used) and 7 (not used)
    reads._count_and_promote(uses, [b.cache.published() for b in backends])
    payload = layout.payload_bytes
    assert payload == 24
    if down_only:  # two copies of 8 bytes, pick 5's gate/up read three times, miss 6 read once
        assert reads.bytes_read == 2 * 8 + 3 * 16 + 1 * payload
    else:  # two copies, one host read of 6 (not 3 + 1 reads)
        assert reads.bytes_read == 2 * payload + 1 * payload
    assert (maps[1].counts.prefetched, maps[1].counts.prefetch_hits) == (2, 1)
    assert maps[1].counts.misses == 2 and maps[0].counts.prefetched == 0


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, "0 2 True False"),
        ({"FT_MOE_HOST_PREFETCH": "3", "FT_MOE_HOST_PREFETCH_DOWN": "1"}, "3 3 True True"),
    ],
)
def test_rows_and_what_they_copy_by_bank_format(env, want):
    """By default bf16 banks prefetch nothing and NVFP4 banks two whole experts a layer (what an
    H200 measured); the environment variables set both formats alike."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("FT_MOE_HOST_PREFETCH")}
    code = (
        "from ft.moe.backends import host_prefetch as h; "
        "print(h.rows('bf16'), h.rows('nvfp4'), h.down_only('bf16'), h.down_only('nvfp4'))"
    )
    run = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == want
