"""Tensor parallelism on awkward model shapes (CPU, gloo, fp32): TP=2 equals TP=1, and TP=1 equals
transformers' forward, where the shapes sit at the edges of what the sharding rules allow.

The shapes ``tests/test_tp.py`` leaves out: as many query heads as kv heads as ranks; GDN key
and value heads at their minimum (one of each a rank, a ratio of one); a vocabulary that does not
split evenly, tied to the embedding, so the last rank's padding rows are zero in both; a first
layer of full attention and a dense layer among MoE ones (qwen3_next too); a shared expert of an
odd width a rank; top-1 unrenormalised routing, and top-k over every expert; an intermediate
width a rank that is no multiple of 16 (allowed for bf16 experts, refused for NVFP4). A seeded
sampler with penalties and a bias toward the last token, asked for the whole vocabulary's
log-probs, must see the same V logits at either TP size (the padding must not leak into it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ft import LLM, SamplingParams
from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.config_json import load_model_config
from tests.checkpoints import make_hf_model, write_checkpoint
from tests.exactness import max_gap

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33], [30, 1, 64, 19, 7]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=3, logprobs=3, ignore_eos=True)

CASES = {
    # 2 q heads = 2 kv heads = 2 ranks; GDN 2 key / 2 value heads (1 and 1 a rank); 95 = 48 + 47
    # rows; layer 0 attention; layer 2 dense; shared expert 3 wide a rank; top-1, not renormalised
    "next-min-heads": (
        "qwen3_next",
        dict(
            num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2,
            vocab_size=95, tie_word_embeddings=True, num_hidden_layers=3,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            mlp_only_layers=[2], intermediate_size=24, shared_expert_intermediate_size=6,
            num_experts_per_tok=1, norm_topk_prob=False,
        ),
    ),
    # 6 q heads over 1 kv head replicated on both ranks; top-8 of 8 experts; MoE on odd layers only
    # (decoder_sparse_step 2) and layer 3 dense by mlp_only_layers; experts 6 wide a rank
    "moe-replicated-kv-topk-all": (
        "qwen3_moe",
        dict(
            num_attention_heads=6, num_key_value_heads=1, num_experts_per_tok=8, num_hidden_layers=4,
            decoder_sparse_step=2, mlp_only_layers=[3], moe_intermediate_size=12, vocab_size=93,
        ),
    ),
}  # fmt: skip


def sampled(vocab: int) -> list[SamplingParams]:
    """Seeded samples over the whole vocabulary's log-probs, penalised and biased toward its last
    token (a padded rank's rows sit just past it)."""
    return [
        SamplingParams(max_tokens=6, temperature=0.9, seed=11, logprobs=vocab, ignore_eos=True),
        SamplingParams(
            max_tokens=6, temperature=1.3, seed=5, top_k=40, top_p=0.9, repetition_penalty=1.3,
            frequency_penalty=0.5, logit_bias={vocab - 1: 3.0}, logprobs=2, ignore_eos=True,
        ),
    ]  # fmt: skip


def generate(path, tp: int, vocab: int):
    with LLM(model=str(path), tp_size=tp, device="cpu", dtype="float32", progress=False) as llm:
        return llm.generate(PROMPTS * 2, [GREEDY, GREEDY, *sampled(vocab)])


def assert_matches_transformers(hf, outs) -> None:
    """Prompt and sampled log-probs and greedy tokens of ``outs`` (greedy) against ``hf``'s forward
    over the prompt and the generated tokens."""
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0].float(), dim=-1)
        rows = out.prompt_logprobs[1:] + out.logprobs
        for pos, got in enumerate(rows):
            if pos >= len(ids) - 1:  # a generated token: the greedy choice
                assert out.token_ids[pos - len(ids) + 1] == int(ref[pos].argmax())
            assert set(torch.topk(ref[pos], 3).indices.tolist()) <= set(got)
            assert all(abs(lp - float(ref[pos, tok])) < 1e-4 for tok, lp in got.items()), pos


@pytest.mark.parametrize("case", list(CASES))
def test_awkward_shapes_tp2_equals_tp1_equals_transformers(tmp_path, case):
    model_type, overrides = CASES[case]
    # weight_scale 1.0: at 1.2 fp32 rounding alone moved log-probs by 5e-5, TP=1 from transformers
    # as much as TP=2 from TP=1. Even at 1.0 one prompt row of next-min-heads is that sensitive:
    # against transformers in fp64 TP=1 is off by 3.5e-5 there, TP=2 by 5e-6, transformers' fp32
    # forward by 1.6e-5; hence 1e-4 (a sharding mistake moves log-probs by tenths)
    hf = write_checkpoint(tmp_path, model_type, seed=len(case), weight_scale=1.0, **overrides)
    vocab = overrides["vocab_size"]
    one = generate(tmp_path, 1, vocab)
    assert_matches_transformers(hf, one[:2])
    for out in one[2:]:  # the sampled tokens and every log-prob key are real vocabulary ids
        assert all(0 <= t < vocab for t in out.token_ids)
    assert sorted(one[2].logprobs[0]) == list(range(vocab))
    assert all(max_gap(got, want) < 1e-4 for got, want in zip(generate(tmp_path, 2, vocab), one, strict=True))


def config(tmp_path, model_type: str, **overrides):
    """The ModelConfig ft reads from the config.json transformers saves for ``overrides``."""
    make_hf_model(model_type, **overrides).config.save_pretrained(str(tmp_path))
    return load_model_config(str(tmp_path))


def shard(mc, tp: int) -> None:
    for rank in range(tp):
        build_model(mc, TPInfo(rank, tp), "meta", torch.float32)


def test_gdn_heads_that_do_not_split_are_refused_by_name_unless_no_layer_is_gdn(tmp_path):
    """3 GDN key heads over 2 ranks are refused naming linear_num_key_heads; a full_attention_interval
    of 1 (every layer attention, the first included) has no GDN layer, so the same counts build."""
    uneven = dict(linear_num_key_heads=3, linear_num_value_heads=3)
    with pytest.raises(ValueError, match=r"^linear_num_key_heads over tp ranks: 3 is not divisible by 2"):
        shard(config(tmp_path, "qwen3_next", **uneven), 2)
    mc = config(tmp_path, "qwen3_next", layer_types=None, full_attention_interval=1, **uneven)
    assert mc.layer_types == ("full_attention",) * 4 and "moe" in mc.mlp_types
    shard(mc, 2)


def test_intermediate_width_a_rank_below_16_is_bf16_only(tmp_path):
    """moe_intermediate_size 40 over 4 ranks is 10 rows a rank: bf16 experts shard it, NVFP4 ones
    (16-wide scale blocks) are refused with the numbers and what to change."""
    mc = config(tmp_path, "qwen3_moe", moe_intermediate_size=40)
    assert mc.mlp_types == ("moe",) * 3
    shard(mc, 4)
    quantised = dataclasses.replace(mc, expert_format="nvfp4")  # as --quantize-experts nvfp4 asks
    with pytest.raises(ValueError, match=r"40 over 4 tp ranks gives 10 rows per rank.*tp size"):
        build_model(quantised, TPInfo(0, 4), "meta", torch.float32)


@pytest.mark.parametrize("tp", [4, 6])
def test_fewer_query_heads_than_ranks_are_refused_alike(tmp_path, tp):
    """3 query heads cannot go over 4 ranks nor over 6: query heads are never replicated (only kv
    heads are), so both refusals say so, not that a rank count that is a multiple would do."""
    mc = config(tmp_path, "qwen3_moe", num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match=rf"^3 attention heads cannot be split over {tp} ranks"):
        build_model(mc, TPInfo(0, tp), "meta", torch.float32)
