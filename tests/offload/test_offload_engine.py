"""Offloaded experts through the whole engine on CPU: NVFP4 banks in a host store, TP=2 ranks each
streaming their own shard, a host too small refused before any weight is read, the plan line,
and ``ft bench offline`` reporting the offload figures."""

from __future__ import annotations

import json

import pytest
import torch

import ft.engine.model_runner as model_runner
from ft import LLM, SamplingParams
from ft.cli import main
from ft.moe.backends import host_stage
from tests.checkpoints import write_checkpoint
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33], [30, 1, 64, 19, 7]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, logprobs=2, ignore_eos=True)


def generate(path, tp: int = 1, **options):
    with LLM(model=str(path), tp_size=tp, device="cpu", dtype="float32", progress=False, **options) as llm:
        return llm.generate(PROMPTS, PARAMS), llm.engine.stats()


def assert_close(a, b, tol=0.0):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for da, db in zip(x.prompt_logprobs[1:] + x.logprobs, y.prompt_logprobs[1:] + y.logprobs):
            assert da.keys() == db.keys()
            for k in da:
                assert abs(da[k] - db[k]) <= tol


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    write_nvfp4_checkpoint(root, "qwen3_next", seed=5, moe_intermediate_size=64)
    return root


@pytest.mark.parametrize(
    "options",
    [
        dict(moe_backend="offload", expert_cache_fraction=0.25, moe_staging_experts=3),
        dict(moe_backend="hybrid", expert_cache_fraction=0.25),
        dict(moe_backend="cpu"),
        dict(moe_backend="offload", static_experts=3, expert_cache_fraction=0.5, moe_staging_experts=3),
    ],
    ids=["offload", "hybrid", "cpu", "lean"],
)
def test_nvfp4_banks_offloaded_equal_resident(nvfp4, options, monkeypatch):
    want, _ = generate(nvfp4 / "nvfp4", moe_backend="gpu")
    staged = []
    real_stage = host_stage.stage
    monkeypatch.setattr(host_stage, "stage", lambda *a: staged.append(1) or real_stage(*a))
    got, stats = generate(nvfp4 / "nvfp4", **options)
    assert_close(got, want)
    assert stats.moe_hits + stats.moe_misses > 0
    if options["moe_backend"] == "offload" and not options.get("static_experts"):
        # NVFP4 banks' host reads prefetch whole experts and stage the rest by default
        assert stats.moe_prefetched > 0 and staged


def test_nvfp4_tp2_offload_with_host_prefetch_equals_tp1(nvfp4):
    """Each rank's NVFP4 shards offloaded, host reads prefetching whole experts (the format's
    default) on every rank alike: TP=1's outputs."""
    want, _ = generate(nvfp4 / "nvfp4", moe_backend="gpu")
    got, stats = generate(
        nvfp4 / "nvfp4", tp=2, moe_backend="offload", expert_cache_fraction=0.25, moe_staging_experts=3
    )
    assert_close(got, want, tol=1e-5)
    assert stats.moe_prefetched > 0


def test_quantised_at_load_into_the_host_store(nvfp4):
    want, _ = generate(nvfp4 / "bf16", quantize_experts="nvfp4", moe_backend="gpu")
    for static in (0, 2):  # 2: experts 0, 1 quantised straight into their device slots
        got, _ = generate(
            nvfp4 / "bf16",
            quantize_experts="nvfp4",
            moe_backend="offload",
            expert_cache_fraction=0.5,
            static_experts=static,
        )
        assert_close(got, want)


@pytest.mark.parametrize(
    "family, backend", [("qwen3_next", "offload"), ("qwen3_next", "hybrid"), ("qwen3_moe", "offload")]
)
def test_tp2_offload_equals_tp1(tmp_path, family, backend):
    # 4 kv heads split over 2 ranks, each rank caching and streaming its half of every expert;
    # without a shared expert (qwen3_moe) a streamed layer's sum goes to the all-reduce as it is
    write_checkpoint(tmp_path, family, seed=2, num_key_value_heads=4)
    want, _ = generate(tmp_path, moe_backend="gpu")
    got, stats = generate(
        tmp_path, tp=2, moe_backend=backend, expert_cache_fraction=0.25, moe_staging_experts=3
    )
    assert_close(got, want, tol=1e-5)
    assert stats.moe_backend == backend and stats.moe_bytes_h2d > 0


def test_qwen4_exp_offloaded_equals_resident(tmp_path):
    """QSA, PLE and hyper-connections around the MoE sublayer change nothing about its experts."""
    write_qwen4_exp_checkpoint(tmp_path, tiny_qwen4_exp_config(), seed=1)
    want, _ = generate(tmp_path, moe_backend="gpu")
    for backend in ("offload", "hybrid"):
        got, _ = generate(tmp_path, moe_backend=backend, expert_cache_fraction=0.25)
        assert_close(got, want)


def test_too_little_host_memory_fails_before_loading(tmp_path, monkeypatch):
    """4 KiB cannot hold one expert of every layer, even with the others static (lean)."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=3)

    def never(*args, **kwargs):
        raise AssertionError("weights were read before the host-memory check")

    monkeypatch.setattr(model_runner, "load_weights", never)
    with pytest.raises(
        MemoryError, match=r"offloaded experts need .* GiB of host memory .*--max-host-memory"
    ):
        LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False,
            moe_backend="offload", max_host_memory="4KiB")  # fmt: skip


def test_an_expert_cache_size_picks_offload_and_is_refused_beside_gpu(tmp_path, capsys):
    """--expert-cache-fraction / --static-experts size an expert cache: with the backend left to
    choose they offload, saying so (the auto backend picked gpu and ignored them); beside an
    explicit --moe-backend gpu they are refused by name."""
    from ft.config import EngineConfig

    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    with LLM(
        model=str(tmp_path), device="cpu", dtype="float32", progress=False, expert_cache_fraction=0.5
    ) as llm:
        plan = llm.engine.executor.runner.moe.plan
        assert llm.engine.executor.runner.moe.name == "offload" and plan.slots == 4
    assert "--expert-cache-fraction given: experts offloaded" in capsys.readouterr().out
    for option in (dict(expert_cache_fraction=0.5), dict(static_experts=2)):
        with pytest.raises(ValueError, match=f"EngineConfig.{next(iter(option))}=.*gpu MoE backend"):
            EngineConfig(model=str(tmp_path), moe_backend="gpu", **option)


def test_plan_line_and_bench_offline_report_offload(tmp_path, capsys):
    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    args = ["bench", "offline", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]
    args += ["--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4", "--prefill-lens", "16"]
    args += ["--moe-backend", "offload", "--expert-cache-fraction", "0.5", "--expert-cache-policy", "lfu"]
    args += ["--num-tokens", "256"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ft rank 0/1: moe offload (lfu, prefetch on): 3 layers x 4/8 experts resident (50%)" in out
    assert "moe offload: 4/8 experts resident per layer (50%), policy lfu, prefetch on" in out
    assert "1  decode hit rate" in out and "MB over PCIe per token" in out
    # the prefill's streamed bytes: every non-resident expert of the 3 layers at least once (a
    # CPU has no measured copy rate, so no share of the link)
    line = next(x for x in out.splitlines() if x.startswith("prefill 16 tokens:"))
    assert "; streamed " in line and " MB at " in line and "of the link" not in line


def test_bench_offline_reports_the_host_reads_prefetch(tmp_path, capsys, monkeypatch):
    """With host reads' prefetch on (spare rows), the decode rows say how many experts a token had
    prefetched and what share of them its layer read."""
    from ft.moe.backends import host_prefetch, host_reads

    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_prefetch, "ROWS", 2)
    write_checkpoint(tmp_path, "qwen3_next", seed=4)
    args = ["bench", "offline", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]
    args += ["--batch-sizes", "1", "--input-len", "8", "--output-len", "6", "--prefill-lens", ""]
    args += ["--moe-backend", "offload", "--expert-cache-fraction", "0.25", "--num-tokens", "256"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "experts prefetched per token (" in out and "% used)" in out


def test_the_cache_starts_full_with_the_host_store_experts(tmp_path):
    """At start-up every slot is filled from the host store, so the residency the plan line
    reports holds from the first request on."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False,
             moe_backend="offload", expert_cache_fraction=0.5) as llm:  # fmt: skip
        moe = llm.engine.executor.runner.moe
        for cache, store in zip(moe.caches, moe.stores):
            assert cache.map.num_resident == cache.map.num_slots == 4
            for e in range(cache.map.num_experts):
                slot = int(cache.map.slot_of[e])
                if slot != cache.map.null:
                    assert torch.equal(cache.block[slot], store.block[int(store.rows([e])[0])])
            assert cache.table.tolist() == cache.map.slot_of.tolist()


def test_bench_offline_measures_policies_and_skews_on_one_engine(tmp_path, capsys):
    """--expert-cache-policies lru,lfu --dummy-routing-skews 0,1: four reports from one load, in
    order (skew major), each with its own decode hit rates."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    out_json = tmp_path / "bench.json"
    args = ["bench", "offline", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32"]
    args += ["--load-format", "dummy", "--batch-sizes", "1", "--input-len", "8", "--output-len", "4"]
    args += ["--prefill-lens", "", "--moe-backend", "offload", "--expert-cache-fraction", "0.5"]
    args += ["--expert-cache-policies", "lru,lfu", "--dummy-routing-skews", "0,1", "--num-tokens", "256"]
    assert main([*args, "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.count("loading") <= 1 and out.count("ft rank 0/1: moe offload") == 1  # one engine
    reports = json.loads(out_json.read_text())
    got = [(r["moe"]["routing_skew"], r["moe"]["policy"]) for r in reports]
    assert got == [(0.0, "lru"), (0.0, "lfu"), (1.0, "lru"), (1.0, "lfu")]
    assert all(r["rows"][0]["moe_hit_rate"] is not None for r in reports)
    assert "routing skew 1.0" in out and "policy lfu" in out


@pytest.mark.parametrize("tp", [1, 2])
def test_switching_the_moe_variant_equals_loading_it(tmp_path, tp):
    """An engine loaded with uniform routing and LRU, switched in place to skew 1 and LFU, gives
    the outputs of an engine loaded that way (fp32, dummy weights); TP=2 switches every rank."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    options = dict(device="cpu", dtype="float32", progress=False, load_format="dummy", tp_size=tp,
                   moe_backend="offload", expert_cache_fraction=0.5)  # fmt: skip
    with LLM(model=str(tmp_path), **options) as llm:
        llm.engine.set_moe_variant("lfu", 1.0)
        switched = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.plan.moe.policy == "lfu"
        if tp == 1:
            maps = [c.map for c in llm.engine.executor.runner.moe.caches]
            assert all(m.policy == "lfu" for m in maps)
    with LLM(model=str(tmp_path), expert_cache_policy="lfu", dummy_routing_skew=1.0, **options) as llm:
        loaded = llm.generate(PROMPTS, PARAMS)
    with LLM(model=str(tmp_path), **options) as llm:
        uniform = llm.generate(PROMPTS, PARAMS)
    assert_close(switched, loaded)  # dummy weights are drawn per rank: compare at the same TP
    assert any(a.logprobs != b.logprobs for a, b in zip(uniform, loaded))  # the skew changed the routing


def test_a_variant_starts_from_the_start_up_cache(tmp_path, monkeypatch):
    """``set_moe_variant`` puts every cache back to its start-up fill (what each ``ft bench``
    variant then starts from), with the use history forgotten; the outputs stay exact."""
    from ft.moe.backends import host_reads

    monkeypatch.setattr(host_reads, "PROMOTE_SHARE", 1.0)  # every miss promoted: the cache moves
    write_checkpoint(tmp_path, "qwen3_next", seed=4)
    options = dict(device="cpu", dtype="float32", progress=False, moe_backend="offload")
    options["expert_cache_fraction"] = 0.25
    with LLM(model=str(tmp_path), **options) as llm:
        maps = [c.map for c in llm.engine.executor.runner.moe.caches]
        start = [m.slot_of.copy() for m in maps]
        first = llm.generate(PROMPTS, PARAMS)
        assert any((m.slot_of != s).any() for m, s in zip(maps, start))  # promotions moved experts
        llm.engine.set_moe_variant("lru", None)
        assert all((m.slot_of == s).all() and not m.freq.any() for m, s in zip(maps, start))
        again = llm.generate(PROMPTS, PARAMS)
    assert_close(again, first)


def test_a_routing_skew_needs_dummy_weights(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False, moe_backend="offload")
    with llm, pytest.raises(ValueError, match="dummy weights only"):
        llm.engine.set_moe_variant(None, 1.0)


def test_bench_reads_the_moe_counters_twice_a_run(tmp_path):
    """Reading the MoE counters resolves every layer's copy timings: read around every decode step,
    their cost was inside the single-stream wall time. run_batch reads them twice per run and
    still reports the decode steps' hit rate and copied bytes."""
    from ft.bench.offline import run_batch

    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False,
             moe_backend="offload", expert_cache_fraction=0.5) as llm:  # fmt: skip
        engine, reads = llm.engine, []
        real = engine.stats
        engine.stats = lambda: reads.append(1) or real()
        res = run_batch(engine, [[5, 17, 3, 88], [30, 1, 64]], output_len=8)
    assert len(res["decode_steps"]) == 7 and len(reads) == 2
    assert 0 <= res["hit_rate"] <= 1 and res["h2d_per_token"] >= 0


def test_prestaging_at_tp2_equals_tp1(tmp_path, monkeypatch):
    """``staging.PRESTAGE`` with two ranks: the idle engine has every rank stage its own shard of
    the first layers' experts, the next prompts' first layers compute them, and the outputs stay
    TP=1's resident ones (to fp32 rounding, as without pre-staging)."""
    from ft.moe.backends import staging

    write_checkpoint(tmp_path, "qwen3_next")
    want, _ = generate(tmp_path, moe_backend="gpu")
    monkeypatch.setattr(staging, "PRESTAGE", True)
    monkeypatch.setenv("FT_MOE_PRESTAGE", "1")  # the ranks' processes read it
    options = dict(tp_size=2, device="cpu", dtype="float32", progress=False)
    with LLM(model=str(tmp_path), moe_backend="offload", expert_cache_fraction=0.25, **options) as llm:
        for _ in range(2):
            assert_close(llm.generate(PROMPTS, PARAMS), want, tol=1e-5)  # the shards' sum order
        assert llm.engine.stats().moe_prestaged_layers > 0


def test_prestaging_waits_for_the_callers_idle_and_the_bench_reports_it(tmp_path, capsys, monkeypatch):
    """``staging.PRESTAGE`` stages when the caller says the engine is idle (``LLMEngine.idle``: the
    serving loop once the outputs are out, ``LLM.generate`` before it returns), never inside the
    step that finished the last request, whose outputs it would hold back; ``ft bench offline
    --ttft-idle-s`` calls it before each idle TTFT run and reports what each run found staged."""
    from ft.bench.offline import run_batch
    from ft.moe.backends import staging

    write_checkpoint(tmp_path, "qwen3_next")
    monkeypatch.setattr(staging, "PRESTAGE", True)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False,
             moe_backend="offload", expert_cache_fraction=0.25) as llm:  # fmt: skip
        shared = llm.engine.executor.runner.moe.shared
        run_batch(llm.engine, [PROMPTS[0]], output_len=3)  # the engine's own steps only
        assert not shared.prestaged
        llm.engine.idle()
        assert shared.prestaged
    args = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    args += ["--device", "cpu", "--batch-sizes", "1", "--input-len", "12", "--output-len", "3"]
    args += ["--prefill-lens", "", "--moe-backend", "offload", "--expert-cache-fraction", "0.25"]
    assert main([*args, "--ttft-idle-s", "0.01"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("pre-staged while idle: "))
    runs = [int(n) for n in line.split(": ")[1].split(" layers")[0].split(", ")]
    assert len(runs) == 5 and all(n > 0 for n in runs) and "engine.idle() " in line
