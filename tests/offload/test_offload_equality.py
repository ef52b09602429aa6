"""The offload, hybrid and cpu MoE backends give exactly the resident (gpu) backend's outputs.

fp32 on CPU, tiny random qwen3_next and qwen3_moe checkpoints (8 experts, top-2): prompt
log-probs (prefill), greedy tokens and their log-probs (decode), one-shot and chunked prefill, for
cache sizes from one slot per layer to all eight, with prefetch on and off, both eviction
policies, small double-buffered staging and device-to-device staging of hits. On a CPU-only
machine the "device" cache is another CPU tensor: what runs is the slot map, the eviction, the
expert -> slot remapping, the streaming and the CPU kernels, the logic the GPU runs too.
"""

from __future__ import annotations

import pytest
import torch

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint
from tests.offload.equality import PARAMS, PROMPTS, assert_same, engine, generate

CASES = {
    "1-slot-no-prefetch": dict(moe_backend="offload", expert_cache_fraction=0.125, moe_prefetch=False),
    "1-slot-prefetch": dict(moe_backend="offload", expert_cache_fraction=0.125),
    "2-slots-lru-staging-2": dict(moe_backend="offload", expert_cache_fraction=0.25, moe_staging_experts=2),
    "5-slots-lfu-d2d": dict(
        moe_backend="offload",
        expert_cache_fraction=0.625,
        expert_cache_policy="lfu",
        moe_prefill_hit_d2d=True,
        moe_staging_experts=3,
    ),
    "all-slots": dict(moe_backend="offload", expert_cache_fraction=1.0),
    "hybrid-2-slots": dict(moe_backend="hybrid", expert_cache_fraction=0.25),
    "hybrid-no-prefetch": dict(moe_backend="hybrid", expert_cache_fraction=0.5, moe_prefetch=False),
    "cpu": dict(moe_backend="cpu"),
}
CHUNKED = ("1-slot-prefetch", "2-slots-lru-staging-2", "5-slots-lfu-d2d", "hybrid-2-slots", "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_one_shot_prefill_and_decode_equal_resident(ckpt, refs, case):
    outs, stats = generate(ckpt, **CASES[case])
    assert_same(outs, refs[8192])
    assert stats.moe_backend == CASES[case]["moe_backend"] and stats.moe_layers > 0
    assert stats.moe_hits + stats.moe_misses > 0 and stats.moe_tokens > 0
    if case == "all-slots":  # nothing is ever evicted and most uses hit
        assert stats.moe_hits > stats.moe_misses and stats.moe_evictions == 0


@pytest.mark.parametrize("case", CHUNKED)
def test_chunked_prefill_equals_resident(ckpt, refs, case):
    outs, _ = generate(ckpt, max_num_batched_tokens=5, **CASES[case])
    assert_same(outs, refs[5])


def test_decode_uses_the_cache_and_prefetch_predicts(ckpt, refs, copying_decode):
    outs, s = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.5)
    assert_same(outs, refs[8192])
    assert s.moe_resident == s.moe_layers * s.moe_slots  # decode filled every slot
    assert s.moe_bytes_h2d > 0 and s.moe_evictions > 0 and s.moe_prefetched > 0
    assert 0 < s.moe_prefetch_hits <= s.moe_prefetched and 0 < s.moe_hit_rate < 1
    assert s.moe_residency == 0.5 and s.moe_bytes_per_token > 0


def test_dummy_weights_fill_the_host_store(ckpt):
    def dummy(**options):
        with LLM(
            model=str(ckpt), load_format="dummy", device="cpu", dtype="float32", progress=False, **options
        ) as llm:
            return llm.generate(PROMPTS[:1], PARAMS[:1])

    assert_same(dummy(moe_backend="offload", expert_cache_fraction=0.25), dummy(moe_backend="gpu"))


def test_a_prefill_chunk_prefetches_nothing(ckpt):
    """A chunk that routes to more experts than a layer's dynamic slots streams them; prefetching
    its prediction would only evict experts the next layer streams again."""
    with engine(ckpt, moe_backend="offload", expert_cache_fraction=0.25) as llm:
        assert llm.engine.stats().moe_bytes_h2d == 0  # the start-up fill of the cache is not counted
        llm.generate([list(range(1, 41))], SamplingParams(max_tokens=1, temperature=0.0))
        s = llm.engine.stats()
    assert s.moe_prefetched == 0 and s.moe_bytes_h2d > 0  # streamed, not prefetched


@pytest.mark.parametrize(
    "buffers, ahead, rows", [(2, 0, 2), (2, 1, 2), (2, 2, 2), (3, 2, 2), (3, 3, 2), (3, 1, 1)]
)
@pytest.mark.parametrize("d2d", [False, True])
def test_a_long_batch_streams_the_next_layers_experts_ahead(
    ckpt, refs, d2d, buffers, ahead, rows, monkeypatch
):
    """The three prompts prefill as one batch of 24 tokens x top-2, 6 pairs per expert: with
    --moe-stream-ahead each layer stages the next one's first ``AHEAD_GROUPS`` groups (of ``rows``
    experts; 6 of the 8 are on the host) before that layer's router runs, and the first layer
    stages its own before its mixer, through two or three staging buffers taken in turn (three
    groups of 2: with three buffers the whole layer ahead; six of 1: each buffer refilled once its
    group is read); results are unchanged."""
    from ft.moe.backends import sizing, staging

    monkeypatch.setattr(sizing, "STAGING_BUFFERS", buffers)
    monkeypatch.setattr(staging, "AHEAD_GROUPS", max(ahead, 1))
    options = dict(expert_cache_fraction=0.25, moe_staging_experts=rows, moe_prefill_hit_d2d=d2d)
    with engine(ckpt, moe_backend="offload", moe_stream_ahead=bool(ahead), **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        shared = llm.engine.executor.runner.moe.shared
        layers = llm.engine.stats().moe_layers
    assert_same(outs, refs[8192])
    assert len(shared.staging.blocks) == buffers
    assert shared.ahead_used == layers * ahead  # each layer, its groups once


@pytest.mark.parametrize("after", [True, False])
@pytest.mark.parametrize("d2d", [False, True])
def test_hits_after_the_first_group_staged_ahead(ckpt, refs, d2d, after, monkeypatch):
    """``streaming.HITS_AFTER_AHEAD`` (on by default): a layer with groups staged ahead computes its
    first group, then its hits in place (with --moe-prefill-hit-d2d there are none), then the
    rest; a layer without (streaming ahead off), or every layer with the switch off, its hits
    first. The outputs stay the resident backend's."""
    from ft.moe.backends import pairs, streaming

    monkeypatch.setattr(streaming, "HITS_AFTER_AHEAD", after)
    real, order = pairs.Terms.run, []

    def spy(terms, bank, tensors, x, tok, *rest):
        kind = "staged" if any(tensors is t for t in staging.tensors) else "hits"
        order.append((id(terms), kind, len(tok)))
        return real(terms, bank, tensors, x, tok, *rest)

    monkeypatch.setattr(pairs.Terms, "run", spy)
    options = dict(expert_cache_fraction=0.25, moe_staging_experts=2, moe_prefill_hit_d2d=d2d)
    for ahead in (True, False):
        order.clear()
        with engine(ckpt, moe_backend="offload", moe_stream_ahead=ahead, **options) as llm:
            staging = llm.engine.executor.runner.moe.shared.staging
            outs = llm.generate(PROMPTS, PARAMS)
        assert_same(outs, refs[8192])
        layers = {}
        for out, kind, n in order:
            if n:  # a call with pairs (with d2d the hits' call has none)
                layers.setdefault(out, []).append(kind)
        prefill = [kinds for kinds in layers.values() if len(kinds) > 1]  # the streamed layers' calls
        assert prefill
        want = ["staged", "hits"] if ahead and after else ["hits", "staged"]
        if d2d:
            want = ["staged", "staged"]
        assert all(kinds[:2] == want for kinds in prefill), prefill


def test_streamed_pairs_take_their_batchs_kernel_path(ckpt):
    """Every kernel call of a streamed batch is told the batch's size (``batch_tokens``), so a GPU
    kernel that picks GEMV or MMA by size picks for the pairs what it picks for the batch; and
    every call, on the cache's slots or a staging buffer, the model's experts (``batch_experts``),
    by which the GPU kernels pick their tile table as the resident call does."""
    from ft.moe.backends.runtime import moe_blocks

    with engine(ckpt, moe_backend="offload", expert_cache_fraction=0.25, moe_staging_experts=2) as llm:
        calls, experts = [], []
        for block in moe_blocks(llm.engine.executor.runner.model):
            bank, real = block.experts, block.experts.kernel

            def spy(x, *args, batch_tokens=None, real=real, **kw):  # into: the call's rows of x
                calls.append((len(kw["into"].tokens) if kw.get("into") else len(x), batch_tokens))
                experts.append(kw.get("batch_experts"))
                return real(x, *args, batch_tokens=batch_tokens, **kw)

            bank.kernel = spy
        llm.generate([list(range(1, 25))], SamplingParams(max_tokens=1, temperature=0.0))
    streamed = [c for c in calls if c[1] is not None]
    assert streamed and all(tokens == 24 for _, tokens in streamed)
    assert any(rows < 24 for rows, _ in streamed)  # parts of the batch, told its size
    assert set(experts) == {bank.num_experts}, experts  # staging buffers hold fewer rows


def test_a_streamed_layer_uploads_its_pairs_once(ckpt, refs, monkeypatch):
    """Every kernel call of a streamed layer (the hits in place, each staging group) takes its
    pairs and weight rows from one upload of the layer's, in order, empty runs included."""
    import numpy as np

    from ft.moe.backends import pairs, streaming

    runs = [
        (np.array([3, 1]), np.array([0, 0])),
        (np.zeros(0, np.int64),) * 2,
        (np.array([7]), np.array([2])),
    ]
    weights = torch.arange(16.0).view(8, 2) / 16  # k = 2: pair p is token p // 2
    got = pairs.upload_pairs(runs, weights)
    assert [(t.tolist(), (w[:, 0] * 16).tolist(), r.tolist(), p.tolist()) for t, w, r, p in got] == [
        ([1, 0], [3, 1], [0, 0], [3, 1]), ([], [], [], []), ([3], [7], [2], [7])
    ]  # fmt: skip
    uploads, streamed = [], []
    real_upload, real_stream = pairs.upload, streaming.stream
    monkeypatch.setattr(
        pairs, "upload", lambda t, device: (uploads.append(len(t)), real_upload(t, device))[1]
    )
    monkeypatch.setattr(streaming, "stream", lambda *a, **kw: (streamed.append(1), real_stream(*a, **kw))[1])
    options = dict(moe_backend="offload", expert_cache_fraction=0.25, moe_staging_experts=2)
    with engine(ckpt, **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same(outs, refs[8192])
    assert streamed and len(uploads) == len(streamed)  # one a streamed layer, whatever its groups


def test_device_runs_equal_the_hosts_grouping():
    """``device_runs`` gives ``upload_pairs`` of ``Pairs.of``'s runs: the same tokens, pair
    weights and weight rows in the same order, for runs with given rows (the hits' slots), an
    empty run, experts routed to but in no run (left out) and experts in a run but not routed."""
    import numpy as np

    from ft.moe.backends.pairs import Pairs, device_runs, upload_pairs

    rng = np.random.default_rng(3)
    num_experts, k = 12, 3
    ids_h = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(40)])
    weights = torch.rand(40, k)
    calls = [
        (np.array([1, 4, 7]), np.array([9, 0, 5])),
        (np.zeros(0, np.int64), np.zeros(0, np.int64)),
        (np.array([0, 2, 3]), np.arange(3)),
        (np.array([11, 5, 8]), np.arange(3)),  # 6, 9, 10: in no run
    ]
    grouped = Pairs(ids_h, num_experts)
    want = upload_pairs([grouped.of(*c) for c in calls], weights)
    got = device_runs(torch.from_numpy(ids_h), weights, calls, np.bincount(ids_h.reshape(-1), minlength=12))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a, b)
    assert sum(len(g[0]) for g in got) == 40 * k - sum((ids_h == e).sum() for e in (6, 9, 10))


@pytest.mark.parametrize("chunk", [8192, 5])
@pytest.mark.parametrize("case", ["1-slot-prefetch", "2-slots-lru-staging-2", "5-slots-lfu-d2d"])
def test_terms_the_kernels_write_themselves_equal_resident(ckpt, refs, monkeypatch, case, chunk):
    """``pairs.DIRECT_TERMS``: every streamed call reads its tokens from the batch and writes its
    terms into their rows itself (``Into``), none through ``pair_terms``' gather and scatter;
    the outputs stay the resident backend's."""
    from ft.moe.backends import pairs

    def gathered(*args):
        raise AssertionError("a streamed call gathered its tokens")

    into = []
    real = pairs.Into
    monkeypatch.setattr(pairs, "DIRECT_TERMS", True)
    monkeypatch.setattr(pairs, "pair_terms", gathered)
    monkeypatch.setattr(pairs, "Into", lambda *a: (into.append(1), real(*a))[1])
    outs, _ = generate(ckpt, max_num_batched_tokens=chunk, **CASES[case])
    assert_same(outs, refs[chunk])
    assert into


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("options", [dict(moe_stream_ahead=False), dict(moe_prefill_hit_d2d=True)])
def test_pairs_grouped_on_the_device_or_host_give_the_same_outputs(
    ckpt, refs, monkeypatch, options, on_device
):
    """With ``pairs.DEVICE_PAIRS`` (the default) every streamed layer groups its pairs with
    ``device_runs`` and none with ``Pairs``, without it the other way round; the outputs are the
    resident backend's either way."""
    from ft.moe.backends import pairs

    grouped = []
    used, unused = ("device_runs", "Pairs") if on_device else ("Pairs", "device_runs")
    real = getattr(pairs, used)
    monkeypatch.setattr(pairs, "DEVICE_PAIRS", on_device)
    monkeypatch.setattr(pairs, used, lambda *a: (grouped.append(1), real(*a))[1])
    monkeypatch.setattr(pairs, unused, None)  # the other grouping is not called
    options = dict(options, expert_cache_fraction=0.25, moe_staging_experts=2)
    with engine(ckpt, moe_backend="offload", **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same(outs, refs[8192])
    assert grouped


def test_pairs_of_lists_each_experts_pairs_in_order():
    """``Pairs.of``: the pairs routed to each expert asked for, in the order asked, each expert's
    ascending, with the weight row given for it (default its position) — against a scan."""
    import numpy as np

    from ft.moe.backends.pairs import Pairs

    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(16, 3, replace=False) for _ in range(40)])  # T=40, k=3, E=16
    pairs = Pairs(ids, 16)
    flat = ids.reshape(-1)
    cases = ((np.array([5, 0, 11]), None), (np.array([7, 2]), np.array([9, 4])), (np.array([], int), None))
    for experts, rows in cases:
        sel, got_rows = pairs.of(experts, rows)
        want = [p for e in experts for p in np.flatnonzero(flat == e)]
        row_of = list(range(len(experts))) if rows is None else rows.tolist()
        want_rows = [row_of[i] for i, e in enumerate(experts) for _ in range(int((flat == e).sum()))]
        assert sel.tolist() == want and got_rows.tolist() == want_rows


@pytest.mark.parametrize(
    "options",
    [
        dict(moe_stream_ahead=False),
        dict(moe_prefill_hit_d2d=True, moe_staging_experts=2, moe_stream_ahead=False),
        dict(moe_stream_ahead=True, moe_staging_experts=2),
    ],
    ids=["streamed", "hits-d2d", "stream-ahead"],
)
def test_hybrid_prefill_gives_the_cpu_a_share_and_equals_resident(ckpt, monkeypatch, options):
    """Hybrid prefill: the host CPU computes some host-only experts of each streamed layer (on
    its worker thread) while the rest stream; the prompt log-probs are the resident backend's,
    fewer bytes cross the link than with everything streamed, and with the share off none is
    computed on the CPU; also with resident hits copied device-to-device and with the next
    layer's groups staged ahead (neither is given to the CPU)."""
    from ft.moe.backends import hybrid

    monkeypatch.setattr(hybrid, "CPU_RATES", (1e6, 1e6, 55.0))  # a CPU far faster than the link
    params = [
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, logprobs=2, ignore_eos=True)
    ] * len(PROMPTS)
    with engine(ckpt, moe_backend="gpu") as llm:
        want = llm.generate(PROMPTS, params)
    stats = {}
    for share in (True, False):
        monkeypatch.setattr(hybrid, "PREFILL_CPU", share)
        with engine(
            ckpt, moe_backend="hybrid", expert_cache_fraction=0.25, moe_prefetch=False, **options
        ) as llm:
            assert_same(llm.generate(PROMPTS, params), want)
            stats[share] = llm.engine.stats()
    assert stats[True].moe_cpu_pairs > 0 and stats[False].moe_cpu_pairs == 0
    assert stats[True].moe_bytes_h2d < stats[False].moe_bytes_h2d


def test_cpu_share_balances_the_cpu_against_the_link():
    """``hybrid.cpu_share``: the CPU takes the experts with the fewest pairs, as many as finish no
    later than the link's copies of the rest; none when it is far slower, all but what the link
    streams meanwhile when it is far faster."""
    import numpy as np

    from ft.moe.backends.hybrid import cpu_share

    mb = 6 << 20
    flops = 6.3e6
    pairs = np.full(100, 20)
    even = cpu_share(pairs, mb, flops, (55, 1e9, 55))  # as fast as the link, compute free: half
    assert even == 50
    assert cpu_share(pairs, mb, flops, (0.5, 2.4, 55)) == 0  # a slow CPU takes nothing
    assert cpu_share(pairs, mb, flops, (5500, 1e9, 55)) == 99  # a fast one all but one
    slower = cpu_share(pairs, mb, flops, (54, 2.4, 55))  # its measured rates: compute costs too
    assert 30 < slower < even
    assert cpu_share(np.zeros(0), mb, flops) == 0


@pytest.mark.parametrize(
    "case", ["1-slot-prefetch", "2-slots-lru-staging-2", "5-slots-lfu-d2d", "hybrid-2-slots"]
)
def test_routes_counted_on_the_device_equal_resident(ckpt, refs, case, monkeypatch):
    """``host_route.HostRoute`` from counts made on the device (every batch here, where the engine
    does so from ``DEVICE_COUNTS_MIN_PAIRS`` pairs): the same experts, pair counts and guesses as
    the host's count of the copied ids, so the same outputs, prefill chunked or not; the ids reach
    the host only where a path asks for them (here the hybrid backend's CPU decode)."""
    from ft.moe.backends import host_route

    monkeypatch.setattr(host_route, "DEVICE_COUNTS_MIN_PAIRS", 0)
    copies = []
    real = host_route.HostRoute.ids_h.fget

    def counted(route):
        copies.append(route.copied is None)
        return real(route)

    monkeypatch.setattr(host_route.HostRoute, "ids_h", property(counted))
    outs, _ = generate(ckpt, **CASES[case])
    assert_same(outs, refs[8192])
    outs, _ = generate(ckpt, max_num_batched_tokens=5, **CASES[case])
    assert_same(outs, refs[5])
    assert any(copies) == CASES[case]["moe_backend"].startswith("hybrid"), copies


def test_host_route_counts_as_the_host_would(monkeypatch):
    """Both ways of reading a layer's routing give the same counts, guesses and experts."""
    from ft.moe.backends import host_route

    g = torch.Generator().manual_seed(0)
    ids, pred = torch.randint(0, 12, (40, 3), generator=g), torch.randint(0, 12, (40, 3), generator=g)
    on_host = host_route.host_route(ids, pred, 16)
    monkeypatch.setattr(host_route, "DEVICE_COUNTS_MIN_PAIRS", 0)
    on_device = host_route.host_route(ids, pred, 16)
    assert on_device.copied is None and on_host.copied is not None
    for a, b in ((on_host.counts, on_device.counts), (on_host.predicted, on_device.predicted)):
        assert a.tolist() == b.tolist() and len(a) == 16 and a.sum() == 120
    assert on_host.experts.tolist() == on_device.experts.tolist() == sorted(set(ids.reshape(-1).tolist()))
    assert on_device.predicted_experts.tolist() == sorted(set(pred.reshape(-1).tolist()))
    assert on_device.ids_h.tolist() == ids.tolist()
    assert host_route.host_route(ids, None, 16).predicted is None


@pytest.mark.parametrize("on_device", [False, True])
def test_host_route_counts_only_the_real_rows(monkeypatch, on_device):
    """A replayed decode graph's padding rows route too: their experts (and their guesses) are
    not counted, so the copying decode path neither copies nor prefetches them."""
    from ft.moe.backends import host_route

    if on_device:
        monkeypatch.setattr(host_route, "DEVICE_COUNTS_MIN_PAIRS", 0)
    ids = torch.tensor([[0, 1], [2, 3], [9, 10], [1, 4]])
    pred = torch.tensor([[5, 6], [5, 7], [11, 12], [6, 8]])
    real = torch.tensor([True, True, False, True])
    route = host_route.host_route(ids, pred, 16, real)
    assert route.experts.tolist() == [0, 1, 2, 3, 4] and route.counts[1] == 2
    assert route.predicted_experts.tolist() == [5, 6, 7, 8] and route.predicted[6] == 2
    assert route.ids_h.tolist() == ids.tolist()  # every row, as the kernels read them
    assert host_route.host_route(ids, None, 16, real).experts.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "case", ["1-slot-prefetch", "2-slots-lru-staging-2", "5-slots-lfu-d2d", "hybrid-2-slots", "chunked"]
)
def test_prestaged_layers_equal_resident(ckpt, refs, case, monkeypatch):
    """``staging.PRESTAGE``: an idle engine copies its first layers' host-only experts into
    buffers of their own; the next prefill computes those there, streams the rest, and gives the
    resident backend's outputs, chunked or not."""
    from ft.moe.backends import staging

    monkeypatch.setattr(staging, "PRESTAGE", True)
    options = (
        dict(CASES["2-slots-lru-staging-2"], max_num_batched_tokens=5) if case == "chunked" else CASES[case]
    )
    with engine(ckpt, **options) as llm:
        shared = llm.engine.executor.runner.moe.shared
        for round in range(3):
            outs = llm.generate(PROMPTS, PARAMS)
            assert_same(outs, refs[5 if case == "chunked" else 8192])
            assert shared.prestaged, "the idle engine staged nothing"
            if round == 0:
                assert shared.prestage_used == 0  # nothing was staged before the first prompt
        assert shared.prestage_used > 0
        llm.engine.set_moe_variant("lfu")  # a bench variant starts from the start-up state
        assert not shared.prestaged and shared.ahead is None


def test_a_batch_drops_the_last_prestaged_layers_its_activations_need(ckpt, refs, monkeypatch):
    """Room for a batch's activations first: before a forward the pre-staged layers are kept from
    the first on while they fit beside them, the others dropped; outputs unchanged."""
    from ft.moe.backends import staging

    monkeypatch.setattr(staging, "PRESTAGE", True)
    with engine(ckpt, **CASES["1-slot-prefetch"]) as llm:
        runner = llm.engine.executor.runner
        shared = runner.moe.shared
        llm.generate(PROMPTS, PARAMS)
        staged = list(shared.prestaged.items())
        assert len(staged) == len(runner.moe.backends)  # a tiny model: every layer fits the room
        each = staged[0][1].nbytes
        assert all(p.nbytes == each for _, p in staged) and len(staged) > 2
        shared.activation_per_token = each // 12  # 24 tokens: the room of the last two layers' buffers
        shared.prestage_room = len(staged) * each
        shared.fit_prestaged(24)
        assert list(shared.prestaged) == [b for b, _ in staged[:-2]]
        shared.prestage_used = 0
        assert_same(llm.generate(PROMPTS, PARAMS), refs[8192])
        assert 0 < shared.prestage_used <= len(staged) - 2


def test_an_idle_gpus_room_for_prestaged_layers(monkeypatch):
    """``prestage.room_when_idle``: the plan (cap x ratio) less the CUDA context, the live
    tensors other than the pre-staged buffers, and the margin; the allocator's cached blocks
    count as room."""
    from types import SimpleNamespace

    from ft.moe.backends import staging
    from ft.moe.backends.prestage import room_when_idle

    g = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * g, 100 * g))  # 90 used
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 89 * g)  # 1 outside
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 80 * g)  # 9 cached
    cfg = SimpleNamespace(max_gpu_memory_bytes=None, memory_ratio=0.9)
    room = room_when_idle(cfg, torch.device("cuda", 0), prestaged=3 * g)
    assert room == 90 * g - 1 * g - (80 - 3) * g - staging.PRESTAGE_MARGIN


@pytest.mark.parametrize(
    "room, capacity, want",
    [
        (12, [5, 5, 5], [4, 4, 4]),
        (13, [5, 5, 5], [5, 4, 4]),  # what does not divide evenly: the first layers
        (12, [1, 9, 9, 0], [1, 6, 5, 0]),  # a layer short of its share leaves it to the others
        (40, [5, 5, 5], [5, 5, 5]),  # more room than experts on the host
        (2, [0, 0, 5], [0, 0, 2]),
        (0, [5, 5], [0, 0]),
        (-3, [5, 5], [0, 0]),
    ],
)
def test_prestage_rows_share_the_room_out_evenly(room, capacity, want):
    from ft.moe.backends.staging import prestage_rows

    got = prestage_rows(room, capacity)
    assert got == want
    assert sum(got) == min(max(room, 0), sum(capacity)) and all(0 <= g <= c for g, c in zip(got, capacity))


def test_an_idle_engine_spreads_its_prestaged_experts_over_the_layers(ckpt, monkeypatch):
    """A room too small for every layer's host-only experts gives each layer its share
    (``staging.prestage_rows``), the layers' likeliest first."""
    from ft.moe.backends import staging

    monkeypatch.setattr(staging, "PRESTAGE", True)
    with engine(ckpt, **CASES["1-slot-prefetch"]) as llm:
        runtime = llm.engine.executor.runner.moe
        shared, backends = runtime.shared, runtime.backends
        host_only = [len(b.map.absent()) for b in backends]
        each = backends[0].store.layout.expert_bytes
        shared.prestaged.clear()
        shared.prestage_room = (sum(host_only) // 2) * each
        runtime.idle()
        rows = [len(shared.prestaged[b].experts) if b in shared.prestaged else 0 for b in backends]
        assert rows == staging.prestage_rows(sum(host_only) // 2, host_only)
        assert sum(rows) == sum(host_only) // 2 and max(rows) - min(rows) <= 1 and min(rows) > 0, rows


@pytest.mark.parametrize("with_shared", [False, True])
def test_a_streamed_layers_terms_are_summed_by_pair_in_k_order(with_shared):
    """``pairs.Terms``: calls write their pairs' rows in any order (runs of any experts), and each
    token's sum is its k terms in k order, the shared expert's term last, in fp32, rounded once:
    the resident kernels' order, so the streamed sum cannot depend on how the pairs were split."""
    import numpy as np

    from ft.moe.backends.pairs import Terms

    torch.manual_seed(0)
    t, k, h = 7, 3, 5
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    y = (torch.randn(t * k, h) * 100).to(torch.bfloat16)  # pair p's term: token p // k, slot p % k
    shared_term = torch.randn(t, h).to(torch.bfloat16) if with_shared else None
    want = y.view(t, k, h)[:, 0].float()
    for j in range(1, k):
        want += y.view(t, k, h)[:, j].float()
    if with_shared:
        want += shared_term.float()
    for split in (np.arange(t * k), np.random.default_rng(1).permutation(t * k)):
        terms = Terms(x, k, with_shared)
        for run in np.array_split(split, 4):  # four calls
            pair = torch.from_numpy(run)
            terms.put(pair, y[pair])
        assert torch.equal(terms.total(shared_term), want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="shared term"):
        Terms(x, k, with_shared).total(None if with_shared else torch.zeros(t, h, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_streamed_layers_sum_is_a_tensor_of_its_own(dtype):
    """``Terms.total`` returns a fresh contiguous [T, H], in fp32 too (where ``.float()`` of the
    first term would be a strided view of the buffer): the block's all-reduce sums it in place,
    and gloo summed such a view as if contiguous (TP=2 qwen3_moe offloaded: wrong tokens)."""
    from ft.moe.backends.pairs import Terms

    t, k, h = 5, 3, 4
    x = torch.zeros(t, h, dtype=dtype)
    terms = Terms(x, k, shared=False)
    pair = torch.arange(t * k)
    terms.put(pair, torch.randn(t * k, h).to(dtype))
    before = terms.buf.clone()
    total = terms.total()
    assert total.shape == (t, h) and total.dtype == dtype and total.is_contiguous()
    assert total.untyped_storage().data_ptr() != terms.buf.untyped_storage().data_ptr()
    assert torch.equal(terms.buf, before)  # the terms are left as they were written


def test_terms_into_their_rows_beside_a_shared_slot(monkeypatch):
    """``Terms`` with the shared expert's slot ([T, k + 1, H]): the kernel's own writes
    (``DIRECT_TERMS``, rows through ``Into``) fill the rows ``put`` fills, so the totals agree bit
    for bit (the offload tests above have no shared slot on a CPU)."""
    import numpy as np

    from ft.moe.backends import pairs
    from ft.moe.kernels.torch_ref import fused_moe_ref

    class Bank:
        kernel = staticmethod(fused_moe_ref)
        num_experts = 4

        def kernel_weights(self, tensors):
            return tensors["w13"], tensors["w2"]

        def takes_gemv(self, tokens: int) -> bool:
            return False

    gen = torch.Generator().manual_seed(0)
    t, k, e, h, inter = 6, 2, 4, 8, 4
    x = torch.randn(t, h, generator=gen)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=gen), torch.randn(e, h, inter, generator=gen)
    tensors = {"w13": w13, "w2": w2}
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    calls = [(np.array([0, 2]), np.array([0, 2])), (np.array([3, 1]), np.array([3, 1]))]
    runs = pairs.device_runs(ids, weights, calls, np.bincount(ids.reshape(-1).numpy(), minlength=e))
    shared = torch.randn(t, h, generator=gen)
    totals = {}
    for direct in (False, True):
        monkeypatch.setattr(pairs, "DIRECT_TERMS", direct)
        terms = pairs.Terms(x, k, shared=True)
        for run in runs:
            terms.run(Bank(), tensors, x, *run)
        totals[direct] = terms.total(shared)
    assert torch.equal(totals[True], totals[False])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_four_experts_a_token_equal_resident(tmp_path, model_type):
    """With more than two experts a token the order of a token's terms shows in fp32: every
    backend sums them in routing order, the resident CPU kernel as the offloading paths (at two,
    a + b == b + a hides any order)."""
    write_checkpoint(tmp_path, model_type, seed=23, num_experts=16, num_experts_per_tok=4)
    ref, _ = generate(tmp_path, moe_backend="gpu")
    for options, tol in (
        (dict(moe_backend="offload", expert_cache_fraction=1 / 16), 0.0),
        (dict(moe_backend="offload", expert_cache_fraction=0.25, moe_prefetch=False), 0.0),
        (dict(moe_backend="cpu"), 0.0),
        # hybrid's decode adds the hits' sum (the device kernel) and the misses' (the CPU's): two
        # partial sums, not the routing order's one (its prefill streams through ``Terms``: exact)
        (dict(moe_backend="hybrid", expert_cache_fraction=0.25), 1e-5),
    ):
        outs = generate(tmp_path, **options)[0]
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], options
        assert_same(outs, ref, tol)
