"""The engine's exactness invariants over seeded random workloads (``tests/exactness``): chunked
prefill equals one-shot, a prefix-cache hit equals computing fresh, batched equals alone, a
preempted, recomputed request equals one never preempted (and, on the models, incremental decode
equals a full forward), under chunk sizes that split blocks, block sizes, the prefix cache on
and off, one GDN snapshot slot (taken back at every chunk) or many, few running requests and
pools small enough to preempt, decode ahead on and off.

Two harnesses. The symbolic one runs the real engine, scheduler and prefix cache over a runner
whose caches hold token prefixes (``tests/symbolic_runner``): any block, slot or snapshot mix-up
fails where it happens, and outputs must equal the request alone exactly; it runs 200
workloads in two seconds. The model one runs tiny checkpoints of each family against a
reference run of the same checkpoint (each request alone, one shot, no prefix cache).
"""

from __future__ import annotations

import random

import pytest

from ft import LLM
from ft.models.config_json import load_model_config
from tests import exactness, symbolic_runner
from tests.checkpoints import write_checkpoint
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint

FAMILIES = ["qwen3_moe", "qwen3_next", "qwen4_exp"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        paths[family] = path = tmp_path_factory.mktemp(family)
        if family == "qwen4_exp":
            write_qwen4_exp_checkpoint(path, tiny_qwen4_exp_config(), seed=0)
        else:
            write_checkpoint(path, family, seed=3)
    return paths


def symbolic_case(monkeypatch, model: str, vocab: int, seed: int) -> tuple[int, int]:
    """One seeded workload and engine options through the symbolic engine, against each request
    alone; (preemptions, prefix-hit tokens)."""
    rng = random.Random(seed)
    bs, hybrid = rng.choice([1, 2, 3, 4, 8]), rng.random() < 0.6
    jobs = exactness.workload(rng, vocab, bs, sampling=True)
    alone = symbolic_runner.alone(monkeypatch, model, hybrid, bs)
    want = exactness.run(alone, jobs)
    turns = exactness.next_turns(rng, jobs, want, vocab)
    want += exactness.run(alone, turns)
    options = symbolic_runner.random_options(rng, bs, exactness.kv_need(jobs + turns, bs))
    eng = symbolic_runner.engine(monkeypatch, model, hybrid, **options)
    got = exactness.run(eng, jobs + turns)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs, (seed, i, options)
        assert g.prompt_logprobs == w.prompt_logprobs, (seed, i, options)
    stats, cache = eng.stats(), eng.scheduler.cache
    assert stats.kv_blocks_free == stats.kv_blocks_total, "blocks neither free nor cached"
    if cache is not None:  # every snapshot slot free or attached to a cached block
        slots = [n.snapshot for n in cache._snapshotted] + cache._free_snapshots
        assert sorted(slots) == list(range(eng.plan.num_snapshots)), (seed, options)
    return stats.num_preemptions, stats.prefix_hit_tokens


def test_symbolic_engine_equals_each_request_alone(checkpoints, monkeypatch):
    model = str(checkpoints["qwen3_moe"])
    vocab = load_model_config(model).vocab_size
    totals = [symbolic_case(monkeypatch, model, vocab, seed) for seed in range(200)]
    assert sum(p for p, _ in totals) > 50 and sum(h for _, h in totals) > 1000  # the paths ran


# options of the model harness: chunks that split blocks (3, 5) or hold several (16), blocks
# of 2 to 8, one snapshot slot (taken back at every chunk) or many, a pool of the largest request
# (``pool``: and that many blocks more; preemption), few running requests, decode ahead on and
# off, the prefix cache off
MODEL_OPTIONS = [
    dict(block_size=4, max_num_batched_tokens=3, prefix_snapshot_slots=1, max_running_requests=3, pool=0),
    dict(
        block_size=2,
        max_num_batched_tokens=5,
        prefix_snapshot_slots=16,
        max_running_requests=2,
        decode_ahead=False,
    ),
    dict(block_size=8, max_num_batched_tokens=16, enable_prefix_cache=False, max_running_requests=2, pool=0),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_equal_each_request_alone(checkpoints, family):
    """fp32 on CPU: log-probs agree to 5e-5. A chunk or batch of another shape sums the same
    products in another order (matmuls of other row counts, attention over longer masked rows):
    up to 4.3e-5 (relative 1e-5) over 400 random workloads on the qwen3_next checkpoint, whose
    weights make activations grow layer by layer; 1e-5 on the others. A wrong state, block or
    snapshot moves them by 1e-2 or more."""
    path, rng = str(checkpoints[family]), random.Random(FAMILIES.index(family))
    vocab, preempted, hits = load_model_config(path).vocab_size, 0, 0
    with LLM(model=path, device="cpu", dtype="float32", progress=False, max_running_requests=1,
             enable_prefix_cache=False) as alone:  # fmt: skip
        for options in MODEL_OPTIONS:
            options = dict(options)
            bs, pool = options["block_size"], options.pop("pool", None)
            jobs = exactness.workload(rng, vocab, bs)
            want = exactness.run(alone.engine, jobs)
            turns = exactness.next_turns(rng, jobs, want, vocab)
            want += exactness.run(alone.engine, turns)
            assert exactness.full_forward_gap(alone.engine, jobs, want) < 5e-5
            if pool is not None:
                options["num_tokens"] = exactness.kv_need(jobs + turns, bs) + pool * bs
            with LLM(model=path, device="cpu", dtype="float32", progress=False, **options) as llm:
                got = exactness.run(llm.engine, jobs + turns)
                stats = llm.engine.stats()
            for g, w in zip(got, want):
                assert exactness.max_gap(g, w) < 5e-5, options
            preempted += stats.num_preemptions
            hits += stats.prefix_hit_tokens
    assert preempted > 0 and hits > 0  # the paths ran
