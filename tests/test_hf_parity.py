"""Prompt log-probs and greedy tokens equal transformers' fp32 forward on random checkpoints."""

from __future__ import annotations

import zlib

import pytest
import torch

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint

CASES = {
    "next-base": ("qwen3_next", {}),
    "next-ratio3-1kv-half-rope": (
        "qwen3_next",
        dict(
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            num_key_value_heads=1,
            partial_rotary_factor=0.5,
            norm_topk_prob=False,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            num_hidden_layers=3,
        ),
    ),
    "next-tied": (
        "qwen3_next",
        dict(
            tie_word_embeddings=True,
            layer_types=["linear_attention"] * 2 + ["full_attention"],
            num_hidden_layers=3,
        ),
    ),
    "moe-base": ("qwen3_moe", {}),
    "moe-1kv-nonorm-tied-dense": (
        "qwen3_moe",
        dict(num_key_value_heads=1, norm_topk_prob=False, tie_word_embeddings=True, mlp_only_layers=[1]),
    ),
}


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(tmp_path, case):
    model_type, overrides = CASES[case]
    # a fixed seed per case: hash() of a str changes with every process (PYTHONHASHSEED)
    hf = write_checkpoint(tmp_path, model_type, seed=zlib.crc32(case.encode()) % 1000, **overrides)
    prompts = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19]]
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
        )
    for ids, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(hf, ids)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            got = out.prompt_logprobs[pos]
            assert ids[pos] in got
            want_top = torch.topk(ref[pos - 1], 3)
            for tok, lp in got.items():
                assert abs(lp - float(ref[pos - 1, tok])) < 1e-4, (case, pos, tok)
            assert set(want_top.indices.tolist()) <= set(got)
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert out.token_ids == greedy[0, len(ids) :].tolist(), case
