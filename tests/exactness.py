"""Seeded random workloads for the engine's exactness invariants (``tests/test_exactness_fuzz.py``),
driven through an ``LLMEngine`` step by step, and the comparison of their outputs.

A workload is a list of jobs (arrival step, prompt, params) over one stem of tokens: prompts
that stop one token short of a block, exactly at one, one past it, two blocks and a bit, the
whole stem and the stem extended (so one prompt is a strict prefix of another); an identical
prompt submitted in the same step as another; arrivals while a sharer is still being prefilled
and after it has finished. ``next_turns`` adds prompts that extend an earlier job's prompt and
generated tokens (a hit on generated blocks). Not here: the engines the jobs run on.
"""

from __future__ import annotations

import random

from ft.sampling_params import RequestOutput, SamplingParams

Job = tuple[int, list[int], SamplingParams]


def workload(rng: random.Random, vocab: int, block_size: int, sampling: bool = False) -> list[Job]:
    """Jobs over one stem; ``sampling``: some are seeded samples with penalties and stop tokens
    (the sampler's inputs must also equal those of the request run alone)."""
    bs = block_size
    stem = [rng.randrange(1, vocab) for _ in range(rng.randrange(3 * bs + 2, 5 * bs + 3))]
    cuts = [bs - 1, bs, bs + 1, 2 * bs + rng.randrange(1, bs + 1), len(stem)]
    jobs = []
    for _ in range(rng.randrange(4, 7)):
        prompt = stem[: max(1, rng.choice(cuts))]
        if rng.random() < 0.5:
            prompt = prompt + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 2 * bs))]
        jobs.append((rng.choice([0, 0, 1, 2, 4, 12, 30]), prompt, params(rng, vocab, sampling)))
    twin = rng.choice(jobs)
    jobs.append((twin[0], list(twin[1]), twin[2]))  # identical, in the same step
    return jobs


def params(rng: random.Random, vocab: int, sampling: bool, prompt_logprobs: bool = True) -> SamplingParams:
    """Greedy with log-probs (a quarter with prompt log-probs, which compute their whole prompt);
    with ``sampling``, a third seeded samples, a third penalised, a third with stop tokens."""
    extra: dict = {"temperature": 0.0}
    if sampling and rng.random() < 0.3:
        extra.update(temperature=0.9, seed=rng.randrange(1000))
    if sampling and rng.random() < 0.3:
        extra.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    if sampling and rng.random() < 0.3:
        extra.update(stop_token_ids=tuple(rng.sample(range(1, vocab), vocab // 5)), min_tokens=1)
    if prompt_logprobs and rng.random() < 0.25:
        extra["prompt_logprobs"] = 2
    return SamplingParams(max_tokens=rng.randrange(1, 8), logprobs=2, ignore_eos=True, **extra)


def next_turns(rng: random.Random, jobs: list[Job], outs: list[RequestOutput], vocab: int) -> list[Job]:
    """Late jobs whose prompts are an earlier job's prompt, its generated tokens and a few more."""
    turns = []
    for _ in range(2):
        k = rng.randrange(len(jobs))
        prompt = jobs[k][1] + outs[k].token_ids + [rng.randrange(1, vocab) for _ in range(rng.randrange(3))]
        turns.append((rng.choice([40, 60]), prompt, params(rng, vocab, False, prompt_logprobs=False)))
    return turns


def run(engine, jobs: list[Job], max_steps: int = 5000) -> list[RequestOutput]:
    """Each job added at its arrival step (a step may schedule nothing); their final outputs."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    ids, final, step = {}, {}, 0
    while order or engine.has_unfinished_requests():
        while order and jobs[order[0]][0] <= step:
            i = order.pop(0)
            ids[engine.add_request(jobs[i][1], jobs[i][2])] = i
        for out in engine.step():
            if out.finished:
                final[ids[out.request_id]] = out
        step += 1
        assert step < max_steps, f"the workload did not finish in {max_steps} steps"
    return [final[i] for i in range(len(jobs))]


def full_forward_gap(engine, jobs: list[Job], outs: list[RequestOutput]) -> float:
    """Incremental decode equals a full forward: the largest |difference| of each greedy output's
    sampled log-probs and the prompt log-probs of its prompt and generated tokens as one prompt."""
    full = [
        (0, p + out.token_ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=sp.logprobs))
        for (_, p, sp), out in zip(jobs, outs)
    ]
    gap = 0.0
    for (_, p, _), out, whole in zip(jobs, outs, run(engine, full)):
        for decoded, forward in zip(out.logprobs, whole.prompt_logprobs[len(p) :]):
            assert decoded.keys() == forward.keys()
            gap = max(gap, max(abs(decoded[k] - forward[k]) for k in decoded))
    return gap


def kv_need(jobs: list[Job], block_size: int) -> int:
    """The KV tokens, in whole blocks, of the workload's largest request (a pool that holds it
    and little more makes the others wait or be preempted)."""
    tokens = max(len(p) + sp.max_tokens - 1 for _, p, sp in jobs)
    return -(-tokens // block_size) * block_size


def max_gap(got: RequestOutput, want: RequestOutput) -> float:
    """The largest |difference| of two outputs' prompt and sampled log-probs; their tokens, the
    log-probs' token ids and their counts must be equal."""
    assert got.token_ids == want.token_ids, (got.prompt_token_ids, got.token_ids, want.token_ids)
    a = (got.prompt_logprobs or [None])[1:] + (got.logprobs or [])
    b = (want.prompt_logprobs or [None])[1:] + (want.logprobs or [])
    assert len(a) == len(b)
    gap = 0.0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        gap = max(gap, max(abs(x[k] - y[k]) for k in x))
    return gap
