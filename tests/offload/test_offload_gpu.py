"""Offloaded experts on a GPU: pinned host store, side-stream copies, the device table read inside
segmented CUDA graphs, against the resident backend.

- fp32: exactly the resident outputs (torch kernels, top-2, so the sums are order-free), through
  the real asynchronous paths (side stream, events, pinned copies, double-buffered staging).
- bf16: the cache path runs the same Triton kernel on slot rows, so decode equals the resident
  backend's; prefill streams pairs in groups, each call at the whole batch's tiles, their terms
  summed in k order as the resident kernels sum them, so a prompt's log-probs are the resident
  ones bit for bit (top-4 test; the older tests keep their bf16 tolerances); CUDA-graph decode
  with misses equals eager decode.
- hybrid: the CPU computes misses in bf16 with torch, which rounds differently from Triton, so it
  is held to the bf16 format's own error against the fp32 reference.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from ft import LLM, SamplingParams
from tests.checkpoints import family_checkpoints, write_checkpoint
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19], list(range(1, 40))]
PARAMS = [
    SamplingParams(max_tokens=n, temperature=0.0, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    for n in (24, 6, 12)
]
# 4 of 8 slots, top-2: decode batches of up to two sequences are graphed (bs * k <= S)
OFFLOAD = dict(moe_backend="offload", expert_cache_fraction=0.5, moe_staging_experts=3)
# lean host store: experts 0, 1 in slots 0, 1 only, 4 dynamic slots: graphed up to bs 2 as well
LEAN = dict(OFFLOAD, static_experts=2, expert_cache_fraction=0.75)


def generate(path, **options):
    with LLM(model=str(path), progress=False, device="cuda", **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        runner = llm.engine.executor.runner
        info = {
            "stats": llm.engine.stats(),
            "graphed": runner.graphs is not None,
            "breaks": {bs: len(getattr(g, "breaks", ())) for bs, g in runner.graphs.graphs.items()}
            if runner.graphs is not None
            else {},
            "pinned": [s.block.is_pinned() for s in runner.moe.stores],
        }
        return outs, info


def max_logprob_diff(a, b, decode: bool = True) -> float:
    """Largest |difference| of the log-probs both runs report (prompt, and decode if asked)."""
    err = 0.0
    for x, y in zip(a, b, strict=True):
        pairs = zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])
        if decode:
            pairs = [*pairs, *zip(x.logprobs, y.logprobs)]
        for da, db in pairs:
            for k in da.keys() & db.keys():
                err = max(err, abs(da[k] - db[k]))
    return err


ckpt = family_checkpoints(seed=31, weight_scale=0.8)


@pytest.mark.parametrize(
    "switch",
    [
        None,
        "pairs:DEVICE_PAIRS=0",
        "streaming:HITS_AFTER_AHEAD=0",
        "pairs:DIRECT_TERMS=0",
        "transfer:MEMCPY=0",
    ],
)
def test_fp32_offload_equals_resident_exactly(ckpt, monkeypatch, switch):
    """Also with a prefill switch flipped: ``pairs.DEVICE_PAIRS`` off (the streamed layers' pairs
    grouped on the host: the same runs), ``streaming.HITS_AFTER_AHEAD`` off (the hits before the
    first group staged ahead) and ``pairs.DIRECT_TERMS`` off (each streamed call's tokens
    gathered, its terms scattered) and ``transfer.MEMCPY`` off (each run of rows copied by
    ``Tensor.copy_`` instead of cudaMemcpyAsync through ctypes)."""
    if switch is not None:
        name, value = switch.split("=")
        module, attr = name.split(":")
        monkeypatch.setattr(importlib.import_module(f"ft.moe.backends.{module}"), attr, value == "1")
    want, _ = generate(ckpt, dtype="float32", moe_backend="gpu")
    for options in (OFFLOAD, dict(OFFLOAD, moe_prefill_hit_d2d=True, expert_cache_policy="lfu")):
        got, info = generate(ckpt, dtype="float32", **options)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert max_logprob_diff(got, want) == 0.0
        assert all(info["pinned"]) and info["stats"].moe_bytes_h2d > 0


def test_memcpy_copies_the_rows_copy_would(monkeypatch):
    """``transfer.MEMCPY``: torch's libcudart is found in the process, and its cudaMemcpyAsync
    moves the rows ``copy_`` does, host store to device (a registered block, as the store's) and
    device to device, behind the same event."""
    from ft.moe.backends import transfer
    from ft.moe.backends.layout import pin_in_place

    assert transfer.memcpy_async() is not None
    dev = torch.device("cuda")
    src = torch.randint(0, 256, (9, 4096 + 64), dtype=torch.uint8)
    pin_in_place(src)
    for memcpy in (False, True):
        monkeypatch.setattr(transfer, "MEMCPY", memcpy)
        tr = transfer.Transfer(dev)
        dst = torch.zeros(7, src.shape[1], dtype=torch.uint8, device=dev)
        done = tr.issue(dst, [0, 1, 2, 6], src, [4, 5, 6, 0])
        torch.cuda.current_stream().wait_event(done)
        done = tr.issue(dst, [4], dst, [1], h2d=False)
        torch.cuda.current_stream().wait_event(done)
        want = torch.zeros_like(dst, device="cpu")
        want[[0, 1, 2, 6]] = src[[4, 5, 6, 0]]
        want[4] = src[5]
        assert torch.equal(dst.cpu(), want), memcpy
        assert tr.counts.h2d_bytes == 4 * src.shape[1] and tr.counts.d2d_bytes == src.shape[1]


def test_fp32_prestaged_and_device_counted_prefills_equal_resident(ckpt, monkeypatch):
    """``staging.PRESTAGE`` (an idle engine's first layers staged on their own stream, computed
    by the next prefill) and ``host_route.HostRoute``'s counts made on the device (every batch
    here): three rounds on one engine give the resident outputs exactly, and the later rounds'
    first layers compute what was staged."""
    from ft.moe.backends import host_route, staging

    monkeypatch.setattr(staging, "PRESTAGE", True)
    monkeypatch.setattr(host_route, "DEVICE_COUNTS_MIN_PAIRS", 0)
    want, _ = generate(ckpt, dtype="float32", moe_backend="gpu")
    with LLM(model=str(ckpt), progress=False, device="cuda", dtype="float32", **OFFLOAD) as llm:
        for _ in range(3):
            got = llm.generate(PROMPTS, PARAMS)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            assert max_logprob_diff(got, want) == 0.0
        assert llm.engine.stats().moe_prestaged_layers > 0
        assert llm.engine.executor.runner.moe.shared.prestaged  # staged again once idle


def test_prestaged_buffers_of_new_sizes_compile_no_new_alignment(tmp_path, monkeypatch):
    """A pre-staged buffer holds as many experts as its layer had room for, a count that changes
    by layer and from one idle to the next, and each call's pairs are a slice of the batch's
    starting anywhere. The pairs' alignment kernels take the count at run time (compiled for at
    least ``align.ALIGN_MIN_EXPERTS``) and specialise on neither it, the pair count nor the
    slice's alignment, so bf16 prefills on rooms of 9 to 14 experts, shared out over the layers,
    add at most one variant after the first round. Before 53875c5 each new count compiled them
    again inside the prefill that met it; before e000ef9 a count of 1 or 16 and a slice at an odd
    pair did (an H200, 2026-12-03: compiled variants 5, 6, 6, 7, 9, 9 after six rounds)."""
    from ft.moe.backends import prestage, staging
    from ft.moe.kernels import align

    write_checkpoint(tmp_path, "qwen3_moe", seed=4, num_experts=32, weight_scale=0.8)
    rows = iter(range(9, 15))  # the experts pre-staged over all layers after each round

    def room(cfg, device, held: int) -> int:  # asked once the engine is idle: ``llm`` is built
        return next(rows) * llm.engine.executor.runner.moe.backends[0].store.layout.expert_bytes

    fns = (align._align_kernel, align._runs_kernel)
    if not all(hasattr(fn, "device_caches") for fn in fns):
        pytest.skip("this Triton keeps no per-device kernel caches to count")

    def variants() -> int:  # compiled variants: the first item of each device's cache entry
        return sum(len(cache[0]) for fn in fns for cache in fn.device_caches.values())

    monkeypatch.setattr(staging, "PRESTAGE", True)
    monkeypatch.setattr(prestage, "room_when_idle", room)
    monkeypatch.setattr(staging.Shared, "fit_prestaged", lambda shared, tokens: None)  # tiny batches
    with LLM(model=str(tmp_path), progress=False, device="cuda", dtype="bfloat16", **OFFLOAD) as llm:
        shared = llm.engine.executor.runner.moe.shared
        counts = []
        for _ in range(6):
            used = shared.prestage_used
            llm.generate(PROMPTS, PARAMS)
            counts.append((variants(), shared.prestage_used - used))
    assert all(used > 0 for _, used in counts[1:]), counts  # each round read pre-staged buffers
    assert counts[-1][0] - counts[1][0] <= 1, f"alignment variants after each round: {counts}"


def test_bf16_offload_with_graphed_decode_equals_resident(ckpt, copying_decode):
    want, ref_info = generate(ckpt, dtype="bfloat16", moe_backend="gpu")
    got, info = generate(ckpt, dtype="bfloat16", **OFFLOAD)
    assert ref_info["graphed"] and info["graphed"]
    s = info["stats"]
    assert s.moe_misses > 0 and s.moe_evictions > 0, "the test must decode with misses"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max_logprob_diff(got, want) < 2e-2
    assert s.moe_copy_seconds > 0 and s.moe_pcie_gb_s > 0


def test_bf16_offload_equals_resident_with_the_shared_expert_as_a_pair(tmp_path, monkeypatch, copying_decode):
    """With ``triton_moe_gemv.SHARED_AS_PAIR`` on, both backends run a decode batch's shared
    expert inside the routed GEMV (offload: on the slot rows, or as one more term after streamed
    pairs), so the greedy tokens stay the resident ones."""
    from ft.moe.block import SparseMoeBlock
    from ft.moe.kernels import triton_moe_gemv

    taken, decide = [], SparseMoeBlock._shared_as_pair

    def counted(self, x):
        taken.append(decide(self, x))
        return taken[-1]

    monkeypatch.setattr(triton_moe_gemv, "SHARED_AS_PAIR", True)
    monkeypatch.setattr(SparseMoeBlock, "_shared_as_pair", counted)
    write_checkpoint(tmp_path, "qwen3_next", seed=31, weight_scale=0.8)  # shared I = routed I
    want, _ = generate(tmp_path, dtype="bfloat16", moe_backend="gpu")
    got, info = generate(tmp_path, dtype="bfloat16", **OFFLOAD)
    assert info["graphed"] and info["stats"].moe_misses > 0 and any(taken)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max_logprob_diff(got, want) < 2e-2


def test_graphed_offload_decode_equals_eager(ckpt, copying_decode):
    graphed, info = generate(ckpt, dtype="bfloat16", **OFFLOAD)
    eager, eager_info = generate(ckpt, dtype="bfloat16", disable_cuda_graph=True, **OFFLOAD)
    assert info["graphed"] and not eager_info["graphed"]
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert max_logprob_diff(graphed, eager) < 1e-5


def test_graphed_copying_decode_copies_no_padding_rows_experts(tmp_path, copying_decode):
    """Decode batches of 3, 5, 6 and 7 replay the graphs of 4 and 8: their padding rows route
    too, but the experts they pick are neither copied in nor prefetched, so from the same cache
    contents the graphed run hits, misses, prefetches and copies what the eager run does."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=7, weight_scale=0.8, num_experts=32)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(9 + i)] for i in range(7)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    keys = ("moe_hits", "moe_misses", "moe_prefetched", "moe_evictions", "moe_bytes_h2d")

    def run(**options):
        with LLM(
            model=str(tmp_path), progress=False, device="cuda", dtype="bfloat16", **OFFLOAD, **options
        ) as llm:
            llm.engine.set_moe_variant()  # the start-up fill again: the graphs' capture copied some
            before = llm.engine.stats()
            outs = llm.generate(prompts, params)
            after = llm.engine.stats()
            graphs = llm.engine.executor.runner.graphs
            sizes = sorted(graphs.graphs) if graphs is not None else []
            return outs, {k: getattr(after, k) - getattr(before, k) for k in keys}, sizes

    graphed, counts, sizes = run()
    eager, eager_counts, _ = run(disable_cuda_graph=True)
    assert sizes == [1, 2, 4, 8]  # 16 of 32 slots, top-2
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert counts == eager_counts and counts["moe_misses"] > 0


def test_lean_equals_resident_with_graphed_decode(ckpt, copying_decode):
    """Static experts loaded straight into device slots: fp32 exactly the resident outputs (also
    with dummy weights, drawn on the device and split between slots and host rows), bf16 with
    graphed decode equal to the resident tokens and to eager decode."""
    for load_format in ("auto", "dummy"):
        want, _ = generate(ckpt, dtype="float32", moe_backend="gpu", load_format=load_format)
        got, info = generate(ckpt, dtype="float32", load_format=load_format, **LEAN)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert max_logprob_diff(got, want) == 0.0 and all(info["pinned"])
    want, _ = generate(ckpt, dtype="bfloat16", moe_backend="gpu")
    got, info = generate(ckpt, dtype="bfloat16", **LEAN)
    eager, eager_info = generate(ckpt, dtype="bfloat16", disable_cuda_graph=True, **LEAN)
    assert info["graphed"] and not eager_info["graphed"]
    s = info["stats"]
    assert s.moe_misses > 0 and s.moe_evictions > 0 and s.moe_resident >= 2 * s.moe_layers
    assert [o.token_ids for o in got] == [o.token_ids for o in want] == [o.token_ids for o in eager]
    assert max_logprob_diff(got, want) < 2e-2 and max_logprob_diff(got, eager) < 1e-5


def test_lean_sized_from_the_host_and_gpu_budgets(ckpt):
    """A host that holds 5 experts of each layer: 3 static, the slots from the real GPU budget
    (decided before loading, the pools subtracted in advance)."""
    with LLM(model=str(ckpt), progress=False, device="cuda", moe_backend="offload") as llm:
        per_expert = sum(st.layout.expert_bytes for st in llm.engine.executor.runner.moe.stores)
    limit = 5 * per_expert * 10 // 9 + 9  # 0.9 of it (the host minus headroom) holds 5 experts
    want, _ = generate(ckpt, dtype="bfloat16", moe_backend="gpu")
    with LLM(model=str(ckpt), progress=False, device="cuda", dtype="bfloat16", moe_backend="offload",
             max_host_memory=limit) as llm:  # fmt: skip
        got = llm.generate(PROMPTS, PARAMS)
        moe = llm.engine.executor.runner.moe
        assert moe.static == 3 and moe.plan.slots == 8 and all(s.block.shape[0] == 5 for s in moe.stores)
        assert all(c.block.is_cuda for c in moe.caches) and llm.engine.executor.runner.graphs is not None
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max_logprob_diff(got, want) < 2e-2


@pytest.mark.parametrize("backend", ["hybrid", "cpu"])
def test_bf16_hybrid_and_cpu_within_format_error(ckpt, backend):
    ref, _ = generate(ckpt, dtype="float32", moe_backend="gpu")
    resident, _ = generate(ckpt, dtype="bfloat16", moe_backend="gpu")
    got, info = generate(ckpt, dtype="bfloat16", moe_backend=backend, expert_cache_fraction=0.25)
    assert info["graphed"]  # segmented graphs with a CPU break per layer
    # prompt log-probs only: bf16 greedy continuations may part ways after a near tie
    bound = 2 * max_logprob_diff(resident, ref, decode=False) + 0.05
    assert max_logprob_diff(got, ref, decode=False) < bound


def test_nvfp4_offload_equals_resident(tmp_path, copying_decode):
    write_nvfp4_checkpoint(tmp_path, "qwen3_next", seed=8, moe_intermediate_size=64)
    want, _ = generate(tmp_path / "nvfp4", dtype="bfloat16", moe_backend="gpu")
    got, info = generate(tmp_path / "nvfp4", dtype="bfloat16", **OFFLOAD)
    assert info["graphed"] and info["stats"].moe_misses > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max_logprob_diff(got, want) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_offloaded_prompts_have_the_resident_bits_at_top_4(tmp_path, fmt):
    """Top-4, so a token's terms sum differently in another order: an offloaded prefill streams the
    non-resident experts in groups of a few pairs each, and every group's call takes the tiles of
    the whole batch's call (``mma_path``'s ``batch_tokens``), so each pair's term, and the prompt's
    log-probs, are the resident backend's bit for bit whatever the cache holds. At a group's own
    tiles the W4A16 down projection summed its K in another order (the 80B's rows parted within
    their first tokens, 2026-12-06)."""
    if fmt == "nvfp4":
        write_nvfp4_checkpoint(
            tmp_path, "qwen3_next", seed=8, moe_intermediate_size=64, num_experts_per_tok=4
        )
        path = tmp_path / "nvfp4"
    else:
        write_checkpoint(tmp_path, "qwen3_next", seed=31, weight_scale=0.8, num_experts_per_tok=4)
        path = tmp_path
    want, _ = generate(path, dtype="bfloat16", moe_backend="gpu")
    for fraction in (0.25, 0.5):
        got, info = generate(path, dtype="bfloat16", moe_backend="offload", expert_cache_fraction=fraction)
        assert info["stats"].moe_misses > 0
        assert max_logprob_diff(got, want, decode=False) == 0.0, fraction


def test_offloaded_long_prompts_have_the_resident_bits_beyond_128_experts(tmp_path):
    """More than 128 experts and a chunk of more than 2,048 tokens: the resident call takes the
    default tile table's last row, and a streamed group's call, on a staging buffer of fewer
    rows, must take it too (``batch_experts``), not the 128-expert models' table, whose W4A16
    gate/up row steps K by 64 where the default's steps by 128."""
    write_nvfp4_checkpoint(
        tmp_path,
        "qwen3_next",
        seed=8,
        moe_intermediate_size=64,
        num_experts=160,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
    )
    path, prompt = tmp_path / "nvfp4", [(i * 7919 + 13) % 96 for i in range(2304)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, ignore_eos=True)

    def run(**options):
        with LLM(model=str(path), progress=False, device="cuda", dtype="bfloat16", **options) as llm:
            return llm.generate([prompt], params), llm.engine.stats()

    want, _ = run(moe_backend="gpu")
    got, stats = run(moe_backend="offload", expert_cache_fraction=0.25, moe_staging_experts=8)
    assert stats.moe_misses > 0
    assert max_logprob_diff(got, want, decode=False) == 0.0


@pytest.mark.parametrize("fused", [False, True], ids=["torch-route", "fused-route"])
@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_host_reads_with_graphed_decode_equal_resident(ckpt, tmp_path, monkeypatch, fmt, deferred, fused):
    """``host_reads.ENABLED``: decode batches the MoE GEMV takes read their missed experts from the
    pinned host store in the kernel, in graphs with no break, and give the resident tokens; the
    cache takes in every miss between steps (share 1), so slots change under the graphs, and each
    copy is held back ~1 ms on its stream, so it lands while later steps run. ``fused``: each
    layer's rows and use counts from one kernel (``host_reads.FUSED_ROUTE``)."""
    from ft.moe.backends import host_reads
    from ft.moe.backends.transfer import Transfer

    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_reads, "FUSED_ROUTE", fused)
    monkeypatch.setattr(host_reads, "DEFERRED", deferred)  # the between-step work a step late
    monkeypatch.setattr(host_reads, "PROMOTE_SHARE", 1.0)
    issue_many = Transfer.issue_many  # every copy's way (``issue`` takes it too)

    def late(transfer, *args, **kwargs):  # copies land well after the next step starts
        with torch.cuda.stream(transfer.stream):
            torch.cuda._sleep(2_000_000)
        return issue_many(transfer, *args, **kwargs)

    monkeypatch.setattr(Transfer, "issue_many", late)
    s, info = host_reads_equal_resident(ckpt, tmp_path, fmt)
    assert s.moe_bytes_host_read > 0 and s.moe_evictions > 0 and all(info["pinned"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_offload_equals_tp1(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next", seed=10, num_key_value_heads=4)
    want, _ = generate(tmp_path, dtype="float32", moe_backend="gpu")
    with LLM(
        model=str(tmp_path), tp_size=2, device="cuda", dtype="float32", progress=False, **OFFLOAD
    ) as llm:
        got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max_logprob_diff(got, want) < 1e-4


@pytest.mark.parametrize("down_only", [True, False])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_host_reads_with_prefetch_in_graphs_equal_resident(ckpt, tmp_path, monkeypatch, fmt, down_only):
    """``host_prefetch.rows``: before its mixer each layer picks its predicted host experts and
    copies them into its spare rows on a side stream inside the decode graph; graphed, eager and resident
    give the same tokens, and some picks were used. The choice is held back on the main stream
    (a copy not ordered after it would read the last step's rows to copy) and the copy on the side
    stream (a kernel not waiting for it would read the last step's spare rows), each ~0.5 ms.
    With ``DOWN_ONLY`` the copy moves the picks' down projections, which only the down kernel
    waits for: a down kernel not joined to it would read the last step's."""
    from ft.moe.backends import host_prefetch, host_reads

    monkeypatch.setattr(host_reads, "ENABLED", True)
    for prefix in ("", "NVFP4_"):  # the bank's format picks its own
        monkeypatch.setattr(host_prefetch, f"{prefix}ROWS", 3)
        monkeypatch.setattr(host_prefetch, f"{prefix}DOWN_ONLY", down_only)
    select, copy = host_prefetch.select_into, host_prefetch.copy_rows

    def late_select(*args):
        torch.cuda._sleep(1_000_000)  # clock cycles: ~0.5 ms on an H200
        select(*args)

    def late_copy(*args):
        torch.cuda._sleep(1_000_000)
        copy(*args)

    monkeypatch.setattr(host_prefetch, "select_into", late_select)
    monkeypatch.setattr(host_prefetch, "copy_rows", late_copy)
    s, _ = host_reads_equal_resident(ckpt, tmp_path, fmt)
    assert s.moe_prefetch_hits > 0 and s.moe_bytes_host_read > 0


@pytest.mark.parametrize("prefetch_rows", [0, 3])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_host_reads_staged_in_graphs_equal_resident(ckpt, tmp_path, monkeypatch, fmt, prefetch_rows):
    """Host staging (``host_stage.stages``, forced on for both formats): each host-read layer's
    host experts copied into the device staging block by one kernel after its routing, the MoE
    kernels reading them there, in whole graphs; beside whole-expert host prefetch too. The bytes
    the kernels read from the host before now cross by the staging kernel, counted the same."""
    from ft.moe.backends import host_prefetch, host_reads, host_stage

    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_stage, "STAGE", True)
    monkeypatch.setattr(host_stage, "NVFP4_STAGE", True)
    for prefix in ("", "NVFP4_"):
        monkeypatch.setattr(host_prefetch, f"{prefix}ROWS", prefetch_rows)
        monkeypatch.setattr(host_prefetch, f"{prefix}DOWN_ONLY", False)
    calls, stage = [], host_stage.stage
    monkeypatch.setattr(host_stage, "stage", lambda *args: calls.append(1) or stage(*args))
    s, _ = host_reads_equal_resident(ckpt, tmp_path, fmt)
    assert calls and s.moe_bytes_host_read > 0


def host_reads_equal_resident(ckpt, tmp_path, fmt: str) -> tuple:
    """Offloaded decode (host reads on) graphed and eager against the resident backend, bf16 (or
    NVFP4 experts): batch 1 in one whole graph, the same greedy tokens, log-probs within bf16
    tolerance of the resident run and equal to the eager one's -> (its stats, its info)."""
    path = ckpt
    if fmt == "nvfp4":
        write_nvfp4_checkpoint(tmp_path, "qwen3_next", seed=8, moe_intermediate_size=64)
        path = tmp_path / "nvfp4"
    want, _ = generate(path, dtype="bfloat16", moe_backend="gpu")
    got, info = generate(path, dtype="bfloat16", **OFFLOAD)
    eager, _ = generate(path, dtype="bfloat16", disable_cuda_graph=True, **OFFLOAD)
    assert info["graphed"] and info["breaks"][1] == 0, info["breaks"]  # batch 1: one whole graph
    assert [o.token_ids for o in got] == [o.token_ids for o in want] == [o.token_ids for o in eager]
    assert max_logprob_diff(got, want) < 2e-2 and max_logprob_diff(got, eager) < 1e-5
    return info["stats"], info


def test_decode_ahead_with_host_reads_equals_step_by_step(ckpt, monkeypatch):
    """Decode ahead over host reads (bf16: the Triton banks' GEMV reads the host store, so a
    decode step runs unattended and is issued ahead): the deferred counting and promotions of a
    step run after the batch ahead of it is issued (two steps late), every miss promoted so that
    the routes change under the batches in flight; every token and finish reason stays the same."""
    from ft.moe.backends import host_reads
    from tests.test_decode_ahead import check_ahead_in_the_same_batches

    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_reads, "PROMOTE_SHARE", 1.0)
    check_ahead_in_the_same_batches(ckpt, **dict(OFFLOAD, device="cuda", dtype="bfloat16", block_size=16))


def direct_terms_change_nothing(path, monkeypatch) -> None:
    from ft.moe.backends import pairs

    outs = {}
    for direct in (False, True):
        monkeypatch.setattr(pairs, "DIRECT_TERMS", direct)
        outs[direct], info = generate(path, dtype="bfloat16", **OFFLOAD)
        assert info["stats"].moe_misses > 0
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert max_logprob_diff(outs[True], outs[False]) == 0.0


def test_bf16_terms_the_kernels_write_themselves_change_nothing(ckpt, monkeypatch):
    """``pairs.DIRECT_TERMS``: the bf16 grouped GEMMs read a streamed call's tokens through a row
    map and write its terms into their rows of ``Terms`` (``Into``); the outputs are bit for bit
    those of the gathered calls."""
    direct_terms_change_nothing(ckpt, monkeypatch)


def test_nvfp4_terms_the_kernels_write_themselves_change_nothing(tmp_path, monkeypatch):
    """The same for the W4A16 kernel (NVFP4 banks)."""
    write_nvfp4_checkpoint(tmp_path, "qwen3_next", seed=8, moe_intermediate_size=64)
    direct_terms_change_nothing(tmp_path / "nvfp4", monkeypatch)
