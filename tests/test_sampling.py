"""Sampling: greedy, temperature, top-k, top-p and per-request seeds, batched."""

from __future__ import annotations

import math

import pytest
import torch

from ft import LLM, SamplingParams
from ft.layers.sampler import Sampler, keep_threshold, mix64, seeded_exponential
from tests.checkpoints import write_checkpoint

CPU = torch.device("cpu")


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The former per-row top-k then top-p filter on one row [V], kept as the reference."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """``n`` tokens for one row [V], sampled as one batch of ``n`` copies."""
    return [r.token_id for r in Sampler(CPU, seed)(logits.expand(n, -1), [params] * n, list(range(n)))]


def splitmix64(state: int, n: int) -> list[int]:
    """The published generator with Python integers, to check the tensor version bit for bit."""
    out, mask = [], (1 << 64) - 1
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_mix64_is_splitmix64():
    golden = 0x9E3779B97F4A7C15
    for seed in (1234567, 0, 2**64 - 5, 2**63 + 12345):
        counters = [(seed + k * golden) % 2**64 for k in range(1, 6)]
        signed = torch.tensor([c - 2**64 if c >= 2**63 else c for c in counters])
        assert [v % 2**64 for v in mix64(signed).tolist()] == splitmix64(seed, 5)
    assert splitmix64(1234567, 1) == [6457827717110365317]  # published test vector


def test_seeded_noise_is_exponential_and_keyed_on_seed_and_index():
    noise = seeded_exponential([3, 3, 4], [0, 1, 0], 200_000, CPU)  # [3, V]
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    for row in noise:  # Exp(1): mean 1, variance 1, P(E > 1) = 1/e
        assert abs(float(row.mean()) - 1) < 0.01 and abs(float(row.var()) - 1) < 0.02
        assert abs(float((row > 1).float().mean()) - math.exp(-1)) < 0.005
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(noise[1], seeded_exponential([3], [1], 200_000, CPU)[0])
    assert abs(float(torch.corrcoef(noise[:2])[0, 1])) < 0.01


@pytest.mark.parametrize("every_row_has_top_k", [False, True])  # full sort / top-max(k) window
def test_threshold_matches_the_per_row_filter(every_row_has_top_k):
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(300, vocab, generator=gen) * 3
    logits[::7, 20:] = logits[::7, :20]  # ties, also across the k-th value
    ks = torch.randint(-1, vocab + 5, (300,), generator=gen).tolist()
    ps = (torch.rand(300, generator=gen) * 0.99 + 0.01).tolist()
    ps = [
        1.0 if i % 5 == 0 or (every_row_has_top_k and not 0 < k < vocab) else p
        for i, (k, p) in enumerate(zip(ks, ps))
    ]
    keep = logits >= keep_threshold(logits, ks, ps)
    want = torch.stack([reference_filter(row, k, p).isfinite() for row, k, p in zip(logits, ks, ps)])
    tied = torch.zeros(300, dtype=torch.bool)
    tied[::7] = True  # the reference keeps an arbitrary part of a tied group at the top-p cut
    assert torch.equal(keep[~tied], want[~tied])
    assert bool((keep[tied] | ~want[tied]).all())  # ties: a superset, by whole groups
    assert 0 < int(keep.sum()) < keep.numel()


def test_ties_stay_or_go_together():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0]] * 2)
    # top-k 2 keeps every token tied with the 2nd value; top-p 0.3 keeps the whole tied group
    keep = logits >= keep_threshold(logits, [2, 0], [1.0, 0.3])
    assert keep.int().tolist() == [[0, 1, 1, 1, 0, 1]] * 2
    # top-k 2 sorts a 2-wide window, but top-p still weighs all nine ties with the 2nd value:
    # token 0 holds 45% of the survivors' mass, so at top-p 0.6 the tied group stays
    logits = torch.tensor([[3.0] + [1.0] * 9 + [0.0] * 5])
    assert int((logits >= keep_threshold(logits, [2], [0.6])).sum()) == 10
    assert int((logits >= keep_threshold(logits, [2], [0.4])).sum()) == 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    for params in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=1, seed=3),
    ):
        assert set(draw(logits, params, 20)) == {int(logits.argmax())}


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 2.8, -5.0, -5.0, -6.0])
    assert set(draw(logits, SamplingParams(temperature=5.0, top_k=2), 200)) == {0, 1}
    # the first three tokens hold ~99.9% of the mass: top_p 0.99 never samples the tail
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.99), 300)) == {0, 1, 2}


@pytest.mark.parametrize("seed", [None, 17])
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 4, 1.0), (1.5, -1, 0.8), (2.0, 5, 0.9)]
)
def test_frequencies_follow_the_filtered_distribution(seed, temperature, top_k, top_p):
    logits = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05]))
    n = 20_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    counts = torch.bincount(torch.tensor(draw(logits, params, n)), minlength=7).double()
    p = reference_filter(logits / temperature, top_k, top_p).softmax(-1).double()
    support = p > 0
    assert bool((counts[~support] == 0).all())
    chi2 = float(((counts - n * p)[support] ** 2 / (n * p[support])).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof)  # ~5 sigma of the chi-square law


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))
    seeded = [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=8),
    ]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=3, seed=2),
    ]
    alone = [Sampler(CPU, 0)(logits[i : i + 1], [p], [5])[0].token_id for i, p in enumerate(seeded)]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 4, 0, 2]):
        params = [(seeded + others)[i] for i in order]
        res = Sampler(CPU, 99)(logits[order], params, [5] * 6)
        assert [res[order.index(i)].token_id for i in range(2)] == alone
    # the seed does steer the draw
    steered = {
        Sampler(CPU, 0)(logits[:1], [SamplingParams(temperature=1.0, seed=s)], [5])[0].token_id
        for s in range(20)
    }
    assert len(steered) > 5


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(6))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=10, seed=1)
    params = [greedy if i % 3 == 0 else hot for i in range(8)]
    res = Sampler(CPU, 0)(logits, params, list(range(8)))
    assert all(res[i].token_id == int(logits[i].argmax()) for i in range(0, 8, 3))
    assert any(res[i].token_id != int(logits[i].argmax()) for i in range(8) if i % 3)


def test_unseeded_rows_are_reproducible_for_a_fixed_sampler_seed():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=1.5)] * 16
    runs = [[r.token_id for r in Sampler(CPU, s)(logits, params, [0] * 16)] for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def test_logprobs_are_raw_and_include_the_chosen_token():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5))
    res = Sampler(CPU, 0)(logits, [SamplingParams(temperature=2.0, logprobs=3)], [0])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert res.token_id in res.logprobs and 3 <= len(res.logprobs) <= 4
    assert all(math.isclose(v, float(raw[k]), abs_tol=1e-6) for k, v in res.logprobs.items())


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=float("nan")),
        dict(top_k=-2),
        dict(max_tokens=-1),
        dict(temperature=float("inf")),
        dict(stop_token_ids=[-1]),  # under min_tokens it banned the vocabulary's last token
    ],
)
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_engine_seed_reproducible_and_stop_tokens(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", seed=2)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
        a, b = llm.generate([[1, 2, 3], [1, 2, 3]], [p, p])
        assert a.token_ids == b.token_ids
        stop = a.token_ids[4]
        first = a.token_ids.index(stop)
        c = llm.generate(
            [[1, 2, 3]], SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop_token_ids=[stop])
        )[0]
        assert c.token_ids == a.token_ids[: first + 1] and c.finish_reason == "stop"
        assert a.finish_reason == "length" and len(a.token_ids) == 12


def reference_process(logits: torch.Tensor, params: list[SamplingParams], seen: list) -> torch.Tensor:
    """``process`` token by token: bias, then repetition, then frequency and presence penalties."""
    out = logits.clone().float()
    for r, p in enumerate(params):
        for t, b in p.logit_bias:
            out[r, t] += b
        if not p.penalises:
            continue
        prompt, output = seen[r]
        for t in set(prompt) | set(output) if p.repetition_penalty != 1 else set(output):
            v = out[r, t]
            out[r, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(output):
            out[r, t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_logits_processing_equals_the_token_by_token_reference():
    from ft.layers.penalties import PenaltyState, process

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 40, generator=gen) * 3
    params = [
        SamplingParams(logit_bias={3: 2.5, 17: -100.0}),
        SamplingParams(
            repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3, logit_bias={5: 1.0}
        ),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.1),
    ]
    seen = [None, ([1, 2, 5, 5, 30], [5, 7, 7, 7, 39]), None, ([0], [4, 4, 11])]
    state = PenaltyState(40, logits.device)
    state.load([5, 2], ["b", "d"], [seen[1], seen[3]])
    counts, in_prompt, _ = state.rows([5, 2], ["b", "d"])
    got = process(logits, params, counts, in_prompt)
    torch.testing.assert_close(got, reference_process(logits, params, seen), rtol=0, atol=1e-6)
    assert torch.equal(got[2], logits[2])  # no processing: the logits as they were


def test_penalties_move_greedy_and_min_p_cuts_the_tail():
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sampler.tokens(logits, [greedy], [0]).tolist() == [1]
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.8)
    assert sampler.tokens(logits, [penalised], [2], [([], [1, 1])]).tolist() == [2]  # 5 - 1.6 < 4
    assert sampler.tokens(logits, [SamplingParams(temperature=0.0, logit_bias={3: 4.5})], [0]).tolist() == [3]
    # min_p 0.3: only tokens within log(1/0.3) ~ 1.2 of the best logit survive (1 and 2 here)
    wide = torch.tensor([[0.0, 5.0, 4.0, 3.5]]).repeat(2000, 1)
    picks = sampler.tokens(wide, [SamplingParams(temperature=1.0, min_p=0.3)] * 2000, list(range(2000)))
    assert set(picks.tolist()) == {1, 2}


def test_min_tokens_bans_the_stop_tokens_until_reached():
    """Below its ``min_tokens`` a row may not choose its stop tokens (its stop_token_ids, and the
    model's end-of-sequence tokens unless ``ignore_eos``): greedy and sampled rows take the best
    other token; at ``min_tokens`` they are free again; other rows of the batch are untouched."""
    sampler = Sampler(CPU, 0)
    sampler.eos_ids = (1,)
    logits = torch.tensor([[0.0, 9.0, 4.0, 8.0]])  # eos (1), then the stop token (3), then 2
    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert sampler.tokens(logits, [greedy], [0]).tolist() == [2]
    assert sampler.tokens(logits, [greedy], [2]).tolist() == [2]
    assert sampler.tokens(logits, [greedy], [3]).tolist() == [1]  # three made: it may end
    no_eos = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sampler.tokens(logits, [no_eos], [0]).tolist() == [1]  # eos is no stop token for it
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[3]),
    ]
    picks = sampler.tokens(logits.repeat(2, 1), mixed, [0, 0])
    assert picks[0] == 1 and picks[1] not in (1, 3)
    sampled = sampler.tokens(logits.repeat(500, 1), [mixed[1]] * 500, [4] * 500)
    assert not set(sampled.tolist()) & {1, 3}
    # the log-probs stay the model's
    draw = sampler.draw(logits, [SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)], [0])
    assert draw.tokens.tolist() == [3] and draw.top_i.tolist() == [[1]]


def test_engine_min_tokens_holds_off_the_end(tmp_path):
    """A request whose model wants to end at once (its eos biased up) generates ``min_tokens``
    tokens first, then ends on eos ("stop"), as vLLM's min_tokens does."""
    eos = 7
    write_checkpoint(tmp_path, "qwen3_moe", seed=2, eos_token_id=eos)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        assert llm.engine.model_config.eos_token_ids == (eos,)
        base = dict(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
        now = llm.generate([[1, 2, 3]], SamplingParams(**base))[0]
        assert now.token_ids == [eos] and now.finish_reason == "stop"
        later = llm.generate([[1, 2, 3]], SamplingParams(**base, min_tokens=4))[0]
        assert len(later.token_ids) == 5 and later.token_ids[-1] == eos and eos not in later.token_ids[:4]
        assert later.finish_reason == "stop"


def test_engine_penalties_follow_the_models_logprobs(tmp_path):
    """Greedy with logit bias and frequency / presence penalties (which shift a row's logits and
    its log-softmax alike): each token is the argmax of the model's own log-probs, returned for
    every token of the vocabulary, after the bias and the penalties of the tokens before it."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=2)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        vocab = llm.engine.model_config.vocab_size
        bias = {1: 3.0, 2: -2.0}
        p = SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=vocab, logit_bias=bias,
            frequency_penalty=1.5, presence_penalty=0.7,
        )  # fmt: skip
        out = llm.generate([[5, 6, 7]], p)[0]
        plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids != plain.token_ids  # the knobs change something
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        before = out.token_ids[:i]
        score = {t: v + bias.get(t, 0.0) - 1.5 * before.count(t) - 0.7 * (t in before) for t, v in lp.items()}
        assert tok == max(score, key=score.get), i


def test_counts_kept_between_steps_equal_counts_from_the_tokens():
    """The sampler's per-slot counts, loaded once (``seen`` on a request's first step, again on
    another slot after a preemption) and grown by each drawn token, choose what the tokens so far
    choose; a row whose slot was loaded for another request is refused."""
    gen = torch.Generator().manual_seed(7)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0),
    ]
    prompts, outputs, slots = [[1, 2, 3], [4, 4], [5]], [[], [], []], [4, 1, 7]
    kept, moved = Sampler(torch.device("cpu"), 0), 0
    for step in range(12):
        if step == 6:
            slots[1] = 9  # preempted and admitted again: its tokens sent once more
        load = [step == 0, step in (0, 6), False]
        seen = [(p, o) if go else None for p, o, go in zip(prompts, outputs, load)]
        logits = torch.randn(3, 12, generator=gen)
        rows = [(slot, f"r{i}") for i, slot in enumerate(slots)]
        got = kept.tokens(logits, params, [step] * 3, seen, rows)
        want = Sampler(torch.device("cpu"), 0).tokens(logits, params, [step] * 3, list(zip(prompts, outputs)))
        assert got.tolist() == want.tolist(), step
        moved += int((got != logits.argmax(-1))[:2].sum())
        for o, t in zip(outputs, got.tolist()):
            o.append(t)
    assert moved > 3  # the penalties chose other tokens than the logits alone
    with pytest.raises(RuntimeError, match="slot 4 holds 'r0'"):
        kept.tokens(logits, params, [0] * 3, None, [(4, "other"), (9, "r1"), (7, "r2")])
