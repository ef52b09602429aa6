"""Checkpoints whose dense projections are NVFP4 too (ModelOpt's default recipe quantises every
linear its patterns leave): they load dequantised into the float layers (``ft.quant.dequantized``)
and equal transformers' fp32 forward on the dequantised weights; TP=2 equals TP=1; a broken
companion tensor is named with its file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft.models.checkpoint import CheckpointError
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint
from tests.nvfp4.test_nvfp4_parity import PROMPTS, SMALL, assert_close, generate


def check_against(hf, outs) -> None:
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        for pos in range(1, len(ids)):
            for tok, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(ref[pos - 1, tok])) < 1e-4, (pos, tok)
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out.token_ids == greedy[0, len(ids) :].tolist()


@pytest.mark.parametrize("model_type,declare", [("qwen3_next", "hf_quant_config"), ("qwen3_moe", "config")])
def test_dense_nvfp4_matches_transformers_on_dequantised_weights(tmp_path, model_type, declare):
    hf = write_nvfp4_checkpoint(tmp_path, model_type, seed=11, declare=declare, dense=True, **SMALL)
    stored = load_file(str(tmp_path / "nvfp4" / "model.safetensors"))
    for module in ("lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts.0.up_proj"):
        assert stored[f"{module}.weight"].dtype == torch.uint8, module  # the test quantised them
    attention = [n for n in stored if ".self_attn.o_proj.weight_scale_2" in n]
    assert attention, "an attention projection is NVFP4"
    if model_type == "qwen3_next":
        assert stored["model.layers.0.linear_attn.in_proj_qkvz.weight"].dtype == torch.uint8
        assert stored["model.layers.0.mlp.shared_expert.down_proj.weight"].dtype == torch.uint8
    check_against(hf, generate(tmp_path / "nvfp4"))


def test_dense_nvfp4_at_tp2_equals_tp1(tmp_path):
    # GDN key-head groups reordered from dequantised rows; row-parallel columns of o_proj / out_proj
    write_nvfp4_checkpoint(
        tmp_path, "qwen3_next", seed=12, dense=True, linear_num_key_heads=4, linear_num_value_heads=8, **SMALL
    )
    assert_close(generate(tmp_path / "nvfp4", tp=2), generate(tmp_path / "nvfp4"))


@pytest.mark.parametrize(
    "tensor,change,says",
    [
        ("weight_scale", "drop", r"missing tensor '.*o_proj\.weight_scale': .* declared nvfp4"),
        ("weight_scale_2", "nan", r"o_proj\.weight_scale_2.*finite and >= 0"),
        ("weight_scale", "negative", r"o_proj\.weight_scale' in .*model\.safetensors: block scale \[0, 0\]"),
        ("weight", "float", r"o_proj\.weight' in .*model\.safetensors: stored as torch\.float32 beside"),
    ],
)
def test_a_broken_nvfp4_dense_tensor_is_named_with_its_file(tmp_path, tensor, change, says):
    write_nvfp4_checkpoint(tmp_path, "qwen3_moe", seed=13, dense=True, **SMALL)
    path = tmp_path / "nvfp4" / "model.safetensors"
    tensors = load_file(str(path))
    name = f"model.layers.1.self_attn.o_proj.{tensor}"
    if change == "drop":
        del tensors[name]
    elif change == "nan":
        tensors[name] = torch.tensor(float("nan"))
    elif change == "negative":
        tensors[name] = tensors[name].float().neg().to(torch.float8_e4m3fn)
    else:
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] * 2)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=says):
        generate(tmp_path / "nvfp4")


def test_scale_tensors_of_a_module_declared_unquantised_are_refused(tmp_path):
    """The declaration decides: a module it excludes loads as float, so NVFP4 companions beside
    it are unexpected tensors, named, never guessed at."""
    write_nvfp4_checkpoint(tmp_path, "qwen3_moe", seed=14, dense=True, **SMALL)
    decl_path = tmp_path / "nvfp4" / "hf_quant_config.json"
    decl = json.loads(decl_path.read_text())
    decl["quantization"]["exclude_modules"].append("model.layers.1.self_attn.o_proj")
    decl_path.write_text(json.dumps(decl))
    with pytest.raises(
        CheckpointError, match=r"o_proj\.weight'.*dtype torch\.uint8|unexpected tensor .*o_proj"
    ):
        generate(tmp_path / "nvfp4")
