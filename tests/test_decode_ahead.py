"""Decode ahead (``LLMEngine.step``): the next decode step, issued before the last one's tokens are
read and fed them on the device, gives every request the tokens and finish reasons of the engine
without it, through stop tokens in mid-batch, requests that arrive or are aborted mid-run, and
seeded sampling; and it is taken, not skipped."""

from __future__ import annotations

import pytest

from ft.config import EngineConfig
from ft.engine.engine import LLMEngine
from ft.sampling_params import SamplingParams
from ft.scheduler.step import PENDING_TOKEN
from tests.checkpoints import write_checkpoint

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33], [30, 1, 64, 19], [2, 90, 45, 45, 45, 3, 11], [77, 6]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("next")
    write_checkpoint(path, "qwen3_next", seed=5)
    return path


CPU = {"device": "cpu", "dtype": "float32"}


def make_engine(path, ahead: bool, **options) -> LLMEngine:
    options = {"progress": False, "block_size": 4, **(options or CPU)}
    return LLMEngine(EngineConfig(model=str(path), decode_ahead=ahead, **options))


def counting(engine: LLMEngine) -> list[int]:
    """Count the batches the engine issues ahead (launched with another batch's samples)."""
    launches, launch = [0], engine.executor.launch

    def wrapped(seqs, ids_from=None):
        launches[0] += ids_from is not None
        return launch(seqs, ids_from)

    engine.executor.launch = wrapped
    return launches


def run(engine: LLMEngine, plan: dict, arrivals=(), aborts=()) -> dict:
    """``plan``: request id -> (prompt, params), added at once; ``arrivals``: (step, id, prompt,
    params) added before that step; ``aborts``: (step, id). Every request's tokens, reason and
    log-probs."""
    for rid, (prompt, params) in plan.items():
        engine.add_request(prompt, params, rid)
    done, step = {}, 0
    while engine.has_unfinished_requests() or any(a[0] >= step for a in arrivals):
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(prompt, params, rid)
        for at, rid in aborts:
            if at == step and (out := engine.abort_request(rid)) is not None:
                done[rid] = (list(out.token_ids), "abort", None)
        for out in engine.step():
            if out.finished:
                logprobs = list(out.logprobs) if out.logprobs is not None else None
                done[out.request_id] = (list(out.token_ids), out.finish_reason, logprobs)
        step += 1
    assert engine._ahead is None, "a batch issued ahead outlived its requests"
    return done


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def free_run(path, **options) -> list[list[int]]:
    """Each prompt's greedy tokens, without decode ahead: where to put a stop token."""
    engine = make_engine(path, False, **options)
    out = run(engine, {f"r{i}": (p, greedy(16)) for i, p in enumerate(PROMPTS)})
    engine.shutdown()
    return [out[f"r{i}"][0] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def cpu_run(ckpt):
    return free_run(ckpt)


def stop_at(tokens: list[int], at: int) -> int:
    """A token of ``tokens`` first produced at index ``at`` or later (so a stop on it ends there)."""
    return next(t for i, t in enumerate(tokens) if i >= at and t not in tokens[:i])


def check_ahead_equals_step_by_step(path, tokens: list[list[int]], **options) -> None:
    """Decode ahead on and off give every request the same tokens, finish reasons and log-probs; ``tokens``:
    ``free_run``'s, with the same options (the GPU tests call this too)."""
    seeded = SamplingParams(max_tokens=11, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    plan = {
        "long": (PROMPTS[0], greedy(14, logprobs=2)),
        "stops": (PROMPTS[1], greedy(16, stop_token_ids=[stop_at(tokens[1], 5)])),
        "seeded": (PROMPTS[2], seeded),
        "aborted": (PROMPTS[3], greedy(16)),
    }
    arrivals = [(4, "late", PROMPTS[3][::-1] + [12, 13], greedy(6))]
    aborts = [(7, "aborted")]
    outs, launched = {}, None
    for ahead in (False, True):
        engine = make_engine(path, ahead, **options)
        launches = counting(engine)
        outs[ahead] = run(engine, plan, arrivals, aborts)
        launched = launches[0] if ahead else launched
        assert ahead or launches[0] == 0
        blocks = engine.scheduler.blocks
        cached = engine.scheduler.cache.num_evictable if engine.scheduler.cache is not None else 0
        assert blocks.num_free + cached == blocks.num_blocks, "every block back (or in the prefix cache)"
        engine.shutdown()
    # tokens and reasons exactly; log-probs to fp32 noise (a batch ahead may hold the row of a
    # request that has just stopped: another batch size, another order of sums)
    assert {r: o[:2] for r, o in outs[True].items()} == {r: o[:2] for r, o in outs[False].items()}
    for rid, (_, _, logprobs) in outs[True].items():
        for got, want in zip(logprobs or [], outs[False][rid][2] or []):
            assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-5 for t in got)
    assert outs[True]["stops"][1] == "stop" and outs[True]["long"][1] == "length"
    assert len(outs[True]["long"][2]) == 14  # log-probs: decode ahead takes them too
    assert len(outs[True]["stops"][0]) < 16
    assert launched >= 8, f"only {launched} batches were issued ahead"


def check_ahead_in_the_same_batches(path, **options) -> None:
    """Decode ahead on and off, requests that end by length only: every batch holds the same rows
    either way (no step ahead carries a stopped request's row), so even kernels whose rounding
    depends on the batch's size (bf16 on a GPU) give the same tokens. The GPU tests call this."""
    seeded = SamplingParams(max_tokens=9, temperature=0.9, seed=5, ignore_eos=True)
    plan = {"a": (PROMPTS[0], greedy(14)), "b": (PROMPTS[1], seeded), "c": (PROMPTS[2], greedy(6))}
    outs, launched = {}, 0
    for ahead in (False, True):
        engine = make_engine(path, ahead, **options)
        launches = counting(engine)
        outs[ahead] = run(engine, plan)
        launched = launches[0]
        engine.shutdown()
    assert {r: o[:2] for r, o in outs[True].items()} == {r: o[:2] for r, o in outs[False].items()}
    assert launched >= 8, f"only {launched} batches were issued ahead"


def test_decode_ahead_in_the_same_batches(ckpt):
    check_ahead_in_the_same_batches(ckpt, **CPU)


@pytest.mark.parametrize("running", [64, 2])
def test_decode_ahead_equals_step_by_step(ckpt, cpu_run, running):
    """Also with two running places for five requests: the others wait, and the steps ahead go
    on while the places are full."""
    check_ahead_equals_step_by_step(ckpt, cpu_run, max_running_requests=running, **CPU)


def test_the_last_request_stopping_drops_the_batch_ahead(ckpt, cpu_run):
    """The last running request ends on a stop token: the batch issued after its step has no
    request left, is waited out and dropped, and the engine runs the next request as usual."""
    at = 4
    stops = [cpu_run[0][at], cpu_run[2][at]]
    plan = {
        "a": (PROMPTS[0], greedy(16, stop_token_ids=stops)),
        "b": (PROMPTS[2], greedy(16, stop_token_ids=stops)),
    }
    engine = make_engine(ckpt, True)
    out = run(engine, plan)
    assert all(reason == "stop" for _, reason, _ in out.values())
    assert len(out["a"][0]) <= at + 1 and len(out["b"][0]) <= at + 1
    again = run(engine, {"c": (PROMPTS[0], greedy(6))})
    assert again["c"][0] == cpu_run[0][:6]
    engine.shutdown()


def test_an_id_taken_again_while_its_step_ahead_runs_gets_none_of_its_result(ckpt, cpu_run):
    """A request aborted while its step ahead runs, and its id given at once to a new request: the
    result of that step is the old request's, and the new one starts from its own prompt."""
    engine = make_engine(ckpt, True)
    engine.add_request(PROMPTS[0], greedy(10), "a")
    engine.add_request(PROMPTS[1], greedy(10), "b")
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None
    engine.abort_request("a")
    out = run(engine, {"a": (PROMPTS[0], greedy(6))})
    assert out["a"][:2] == (cpu_run[0][:6], "length") and out["b"][0] == cpu_run[1][:10]
    engine.shutdown()


def test_schedule_ahead_only_when_the_next_batch_is_known(ckpt):
    engine = make_engine(ckpt, False)
    sched = engine.scheduler
    engine.add_request(PROMPTS[0], greedy(3), "x")
    engine.step()  # the prompt: a prefill is not a decode batch
    batch = sched.schedule().seqs
    ahead = sched.schedule_ahead(batch)
    req = sched.requests["x"]
    assert ahead is not None and len(ahead) == 1
    seq = ahead[0]
    assert seq.token_ids == [PENDING_TOKEN] and seq.start == req.num_tokens == batch[0].start + 1
    assert seq.output_index == len(req.output_token_ids) + 1 and seq.sample
    assert seq.history == req.all_token_ids[-len(seq.history) :]
    assert seq.num_blocks * 4 >= req.num_tokens + 1
    engine.add_request(PROMPTS[1], greedy(3), "waits")
    assert sched.schedule_ahead(batch) is None  # the next schedule would admit it
    sched.max_running = 1
    assert sched.schedule_ahead(batch) is not None  # it cannot be admitted: the place is taken
    sched.max_running = 64
    budget, sched.max_batched_tokens = sched.max_batched_tokens, 1
    assert sched.schedule_ahead(batch) is not None  # nor here: the decodes take the whole budget
    sched.max_batched_tokens = budget
    sched.abort("waits")
    assert sched.schedule_ahead(batch) is not None
    req.params = greedy(2)  # the token in flight would be its second and last
    assert sched.schedule_ahead(batch) is None
    engine.shutdown()


def test_decode_ahead_with_two_ranks_equals_step_by_step(ckpt, cpu_run):
    """Two tensor-parallel ranks: each launches the batch ahead, the second taking the first's
    samples by broadcast; tokens and finish reasons are the one-rank engine's."""
    check_ahead_equals_step_by_step(ckpt, cpu_run, tp_size=2, device="cpu", dtype="float32")


def test_penalised_requests_are_decoded_ahead_with_the_same_tokens(ckpt):
    """The sampler counts each drawn token on the device (``ft.layers.penalties``), so a step
    ahead penalises the token in flight it never saw: penalised requests, greedy and seeded,
    decode ahead and give the step-by-step tokens."""
    for params in (
        greedy(10, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=10, temperature=1.0, seed=3, frequency_penalty=2.0, ignore_eos=True),
        greedy(10, logit_bias={3: 1.5}),
    ):
        outs = {}
        for ahead in (False, True):
            engine = make_engine(ckpt, ahead)
            launches = counting(engine)
            outs[ahead] = run(engine, {"r": (PROMPTS[0], params), "s": (PROMPTS[1], params)})
            assert (launches[0] > 0) == ahead
            engine.shutdown()
        assert outs[True] == outs[False]


@pytest.mark.parametrize(
    "backend, host_reads_on, taken",
    [("offload", True, True), ("offload", False, False), ("hybrid", True, False)],
)
def test_decode_ahead_only_where_a_step_runs_without_the_host(
    ckpt, monkeypatch, backend, host_reads_on, taken
):
    """Offloaded experts: a decode step whose misses the kernels read in place (host reads) runs
    without the host and is issued ahead; one that copies them in (reading its routing back) or
    computes them on the CPU (hybrid) is not, or the tokens before it would come out a step late.
    Same tokens either way."""
    from ft.moe.backends import host_reads

    monkeypatch.setattr(host_reads, "ENABLED", host_reads_on)
    options = dict(CPU, moe_backend=backend, expert_cache_fraction=0.5)
    plan = {"r": (PROMPTS[0], greedy(8)), "s": (PROMPTS[2], greedy(8))}
    outs = {}
    for ahead in (False, True):
        engine = make_engine(ckpt, ahead, **options)
        launches = counting(engine)
        outs[ahead] = run(engine, plan)
        assert (launches[0] > 0) == (ahead and taken)
        assert engine.plan.moe.unattended_tokens == (host_reads.CPU_MAX_TOKENS if taken else 0)
        engine.shutdown()
    assert outs[True] == outs[False]


def test_decode_ahead_switched_off_between_steps_issues_no_more(ckpt, cpu_run):
    """``LLMEngine.decodes_ahead`` is public, for a benchmark to switch between steps: switched off
    while a step ahead runs, the engine collects that one and issues no other (the steps ahead had
    gone on to the request's end), with the same tokens."""
    engine = make_engine(ckpt, True)
    launches = counting(engine)
    engine.add_request(PROMPTS[0], greedy(12), "a")
    while launches[0] == 0:
        engine.step()
    engine.decodes_ahead, issued = False, launches[0]
    out = run(engine, {})
    assert out["a"][:2] == (cpu_run[0][:12], "length") and launches[0] == issued
    engine.shutdown()
