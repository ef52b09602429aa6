"""Aborts at any point of a request's life (waiting, mid-way through a chunked prefill, preempted
and waiting to be recomputed, decoding, with a step issued ahead) over seeded random workloads on
the symbolic engine (``tests/symbolic_runner``): every other request still gets the tokens it gets
alone, and once all have ended every KV block, state slot and GDN snapshot slot is free or cached
and unreferenced. ``tests/test_exactness_fuzz.py`` runs the same workloads without aborts."""

from __future__ import annotations

import random

from ft.models.config_json import load_model_config
from ft.scheduler.request import Status
from tests import exactness, symbolic_runner
from tests.checkpoints import write_checkpoint


def kind(req) -> str:
    if req.status is Status.RUNNING:
        return "mid_prefill" if req.num_computed_tokens < req.prompt_len else "decoding"
    return "preempted" if req.num_preemptions else "waiting"


def run_with_aborts(engine, jobs, rng: random.Random, kinds: dict) -> tuple[dict, set]:
    """``exactness.run``, each live request aborted before a step with chance 0.08 (a preempted
    one, rarer, 0.5); the final outputs of those not aborted, and the jobs aborted."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    ids, final, aborted, step = {}, {}, set(), 0
    while order or engine.has_unfinished_requests():
        while order and jobs[order[0]][0] <= step:
            i = order.pop(0)
            ids[engine.add_request(jobs[i][1], jobs[i][2])] = i
        for rid, req in list(engine.scheduler.requests.items()):
            if rng.random() < (0.5 if kind(req) == "preempted" else 0.08):
                kinds[kind(req)] += 1
                out = engine.abort_request(rid)
                assert out.finished and out.finish_reason == "abort"
                aborted.add(ids[rid])
        for out in engine.step():
            if out.finished:
                final[ids[out.request_id]] = out
        step += 1
        assert step < 5000, "the workload did not finish"
    return final, aborted


def test_aborts_lose_nothing_and_leak_nothing(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, "qwen3_moe", seed=3)
    model = str(tmp_path)
    vocab = load_model_config(model).vocab_size
    kinds = dict.fromkeys(["waiting", "mid_prefill", "preempted", "decoding"], 0)
    for seed in range(40):
        rng = random.Random(seed)
        bs, hybrid = rng.choice([1, 2, 3, 4, 8]), rng.random() < 0.6
        jobs = exactness.workload(rng, vocab, bs, sampling=True)
        want = exactness.run(symbolic_runner.alone(monkeypatch, model, hybrid, bs), jobs)
        options = symbolic_runner.random_options(rng, bs, exactness.kv_need(jobs, bs))
        eng = symbolic_runner.engine(monkeypatch, model, hybrid, **options)
        got, aborted = run_with_aborts(eng, jobs, rng, kinds)
        for i in set(range(len(jobs))) - aborted:
            g, w = got[i], want[i]
            assert g.token_ids == w.token_ids and g.logprobs == w.logprobs, (seed, i, options)
            assert g.prompt_logprobs == w.prompt_logprobs, (seed, i, options)
        sched, cache = eng.scheduler, eng.scheduler.cache
        assert eng.stats().kv_blocks_free == sched.blocks.num_blocks, ("blocks neither free nor cached", seed)
        assert sched.slots.num_free == sched.slots.num_slots and eng._ahead is None, seed
        if cache is not None:  # nothing held; every snapshot slot free or attached to a cached block
            assert cache.num_evictable == cache.num_nodes, seed
            slots = [n.snapshot for n in cache._snapshotted] + cache._free_snapshots
            assert sorted(slots) == list(range(eng.plan.num_snapshots)), (seed, options)
    assert min(kinds.values()) > 0, kinds  # the paths ran
