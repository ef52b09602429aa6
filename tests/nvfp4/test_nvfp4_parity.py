"""NVFP4 experts end to end on CPU: prompt log-probs and greedy tokens equal transformers' fp32
forward on the dequantised weights, for both ModelOpt declarations; TP=2 and TP=4 equal TP=1."""

from __future__ import annotations

import pytest
import torch

from ft import LLM, SamplingParams
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19]]
CASES = {
    "next-hf_quant_config": ("qwen3_next", "hf_quant_config", {}),
    "next-config-norenorm": ("qwen3_next", "config", dict(norm_topk_prob=False)),
    "moe-config": ("qwen3_moe", "config", {}),
    "moe-hf_quant_config-dense-layer": ("qwen3_moe", "hf_quant_config", dict(mlp_only_layers=[1])),
}
SMALL = dict(moe_intermediate_size=64)  # I/P stays a multiple of 16 up to P=4


def generate(path, tp: int = 1, **options):
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=3, logprobs=2, ignore_eos=True)
    with LLM(model=str(path), tp_size=tp, device="cpu", dtype="float32", progress=False, **options) as llm:
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_on_dequantised_weights(tmp_path, case):
    model_type, declare, overrides = CASES[case]
    hf = write_nvfp4_checkpoint(tmp_path, model_type, seed=len(case), declare=declare, **SMALL, **overrides)
    for ids, out in zip(PROMPTS, generate(tmp_path / "nvfp4")):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        for pos in range(1, len(ids)):
            got = out.prompt_logprobs[pos]
            assert ids[pos] in got
            for tok, lp in got.items():
                assert abs(lp - float(ref[pos - 1, tok])) < 1e-4, (case, pos, tok)
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out.token_ids == greedy[0, len(ids) :].tolist(), case


def assert_close(a, b, tol=1e-5):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for da, db in zip(x.prompt_logprobs[1:] + x.logprobs, y.prompt_logprobs[1:] + y.logprobs):
            assert da.keys() == db.keys()
            for k in da:
                assert abs(da[k] - db[k]) <= tol


def test_tp2_and_tp4_equal_tp1(tmp_path):
    # GDN key heads 4 -> 1 per rank at TP=4, kv heads 2 replicated there; I/P = 32 and 16
    write_nvfp4_checkpoint(
        tmp_path, "qwen3_next", seed=3, linear_num_key_heads=4, linear_num_value_heads=8, **SMALL
    )
    one = generate(tmp_path / "nvfp4")
    assert_close(generate(tmp_path / "nvfp4", tp=2), one)
    assert_close(generate(tmp_path / "nvfp4", tp=4), one)


def test_quantize_at_load_equals_prequantised_checkpoint(tmp_path):
    write_nvfp4_checkpoint(tmp_path, "qwen3_moe", seed=4, **SMALL)
    assert_close(generate(tmp_path / "bf16", quantize_experts="nvfp4"), generate(tmp_path / "nvfp4"), tol=0)
