"""The engine on a tiny qwen4_exp (QSA genuinely sparse, PLE, hc_mult 2) against the float64 oracle
of tests/reference: prompt log-probs, greedy decoding (incremental decode = full forward),
chunked prefill = one-shot, QSA with a covering selection = dense attention, prefix-cache hit =
miss, batched = alone."""

from __future__ import annotations

import json
import shutil

import torch

from tests.qwen4_exp.conftest import PROMPTS, generate, greedy, max_logprob_gap, prompt_gaps
from tests.reference.qwen4_exp_ref import reference_greedy, reference_logits


def test_prompt_logprobs_and_greedy_decode_match_the_oracle(tiny):
    path, weights, config = tiny
    outs = generate(path, PROMPTS, greedy(16, prompt_logprobs=0, logprobs=0))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(weights, config, prompt, 16)
        ref = torch.log_softmax(reference_logits(weights, config, prompt + out.token_ids), dim=-1)
        assert prompt_gaps(out, ref).max() < 1e-4
        decoded = [
            abs(d[t] - float(ref[len(prompt) - 1 + i, t]))
            for i, (d, t) in enumerate(zip(out.logprobs, out.token_ids))
        ]
        assert max(decoded) < 1e-4
    # the engine really is sparse: late queries disagree with dense attention
    dense = torch.log_softmax(reference_logits(weights, config, PROMPTS[0], qsa_dense=True), dim=-1)
    assert prompt_gaps(outs[0], dense)[25:].max() > 1e-3


def test_chunked_prefill_equals_one_shot(tiny):
    path = tiny[0]
    params = greedy(4, prompt_logprobs=0, logprobs=0)
    one_shot = generate(path, PROMPTS, params, enable_prefix_cache=False)
    # 3 and 5 split QSA blocks of 4; every size splits some PLE 3-gram across two chunks
    for size in (3, 5, 16):
        chunked = generate(path, PROMPTS, params, max_num_batched_tokens=size, enable_prefix_cache=False)
        assert max_logprob_gap(chunked, one_shot) < 1e-5, f"chunk size {size}"


def test_covering_selection_is_dense_attention(tiny, tmp_path):
    path, weights, config = tiny
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = config | {"qsa_topk_blocks": 100}  # every earlier block is among the top K
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = generate(tmp_path, PROMPTS[:1], greedy(1, prompt_logprobs=0))[0]
    dense = torch.log_softmax(reference_logits(weights, config, PROMPTS[0], qsa_dense=True), dim=-1)
    assert prompt_gaps(out, dense).max() < 1e-4


def test_prefix_cache_hit_equals_miss(tiny):
    path = tiny[0]
    shared = PROMPTS[2][:30]
    prompts = [shared, shared, shared + [9, 9, 1], shared[:13] + [50, 51]]
    params = greedy(6, logprobs=3)

    def one_by_one(**options):
        from ft import LLM

        with LLM(
            model=str(path), device="cpu", dtype="float32", progress=False, block_size=4, **options
        ) as llm:
            return [llm.generate([p], params)[0] for p in prompts]

    cold, warm = one_by_one(enable_prefix_cache=False), one_by_one()
    assert max_logprob_gap(warm, cold) < 5e-5  # as tests/test_prefix_cache.py: chunk shapes differ
    assert warm[1].num_cached_tokens == 28 and warm[2].num_cached_tokens == 28


def test_batched_equals_alone(tiny):
    """Sequences of one step read only their own PLE n-grams, QSA blocks and indexer keys: three
    requests together, with chunks of 29 tokens so that prefill chunks and decodes of other
    requests share steps, give each request's tokens and log-probs alone."""
    path = tiny[0]
    params = greedy(5, prompt_logprobs=0, logprobs=2)
    options = dict(enable_prefix_cache=False, max_num_batched_tokens=29)
    alone = [generate(path, [p], params, **options)[0] for p in PROMPTS]
    assert max_logprob_gap(generate(path, PROMPTS, params, **options), alone) < 1e-5


def test_longest_ngram_after_a_prefix_hit_in_small_chunks_matches_the_oracle(tmp_path):
    """PLE's widest context (order 9 reads the 8 tokens the engine carries before a chunk), a
    ple_pad_id that is not 0 and a PLE layer that is a QSA layer: a prompt resumed after a
    prefix-cache hit (its 9-grams straddle the hit) in chunks of 3, then decoded, gives the
    oracle's tokens and log-probs."""
    from ft import LLM
    from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint
    from tests.reference.qwen4_exp_ref import load_checkpoint

    config = tiny_qwen4_exp_config(ple_pad_id=77, ple_ngram_orders=[1, 9], ple_layers=[1, 2])
    write_qwen4_exp_checkpoint(tmp_path, config, seed=4)
    weights, config = load_checkpoint(tmp_path)
    shared = PROMPTS[2][:30]
    params = greedy(4, logprobs=0)
    options = dict(device="cpu", dtype="float32", progress=False, block_size=4, max_num_batched_tokens=3)
    with LLM(model=str(tmp_path), **options) as llm:
        llm.generate([shared], params)  # caches the prefix and its GDN state at token 28
        prompt = shared + [9, 9, 1]
        out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 28
    ref = torch.log_softmax(reference_logits(weights, config, prompt + out.token_ids), dim=-1)
    assert out.token_ids == ref[len(prompt) - 1 : -1].argmax(-1).tolist()
    gaps = [
        abs(d[t] - float(ref[len(prompt) - 1 + i, t]))
        for i, (d, t) in enumerate(zip(out.logprobs, out.token_ids))
    ]
    assert max(gaps) < 1e-4
