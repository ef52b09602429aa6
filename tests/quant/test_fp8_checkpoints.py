"""Block-FP8 checkpoints of the Qwen3 families, as Qwen's official FP8 releases store them: every
linear but the router, shared-expert gate and lm_head as ``weight`` float8_e4m3fn with
``weight_scale_inv`` per block, routed experts included. They load dequantised into the float
layers and a bf16 expert bank (or an NVFP4 one that quantises them at load) and equal
transformers' fp32 forward on the dequantised weights; TP=2 equals TP=1; a broken scale is
named with its file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft import LLM, SamplingParams
from ft.models.checkpoint import CheckpointError
from ft.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block
from tests.checkpoints import write_checkpoint

BLOCK = (16, 32)  # smaller than Qwen's 128 x 128 so that blocks split rows, heads and ranks
KEPT = ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate", "conv1d")
PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19]]


def write_fp8_checkpoint(root, model_type: str, seed: int, scale_dtype=torch.float32, **overrides):
    """``root/fp8`` (declared in config.json) and ``root/dequant`` (its dequantisation in fp32);
    returns transformers' fp32 model on the latter."""
    from transformers import AutoModelForCausalLM

    src = root / "src"
    write_checkpoint(src, model_type, seed, **overrides)
    fp8, dequant = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and w.dim() == 2 and not any(k in name for k in KEPT):
            q, s = quantize_fp8_block(w, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, s.to(scale_dtype)
            dequant[name] = dequantize_fp8_block(q, s.to(scale_dtype).float(), BLOCK, torch.float32)
        else:
            fp8[name] = dequant[name] = w
    config = json.loads((src / "config.json").read_text())
    for sub, tensors in (("fp8", fp8), ("dequant", dequant)):
        (root / sub).mkdir()
        save_file(tensors, str(root / sub / "model.safetensors"))
        shutil.copy(src / "generation_config.json", root / sub)
    declaration = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "*.mlp.gate", "*.shared_expert_gate"],
    }
    (root / "fp8" / "config.json").write_text(json.dumps(config | {"quantization_config": declaration}))
    (root / "dequant" / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32).eval()


def generate(path, tp: int = 1, **options):
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    with LLM(model=str(path), tp_size=tp, device="cpu", dtype="float32", progress=False, **options) as llm:
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize(
    "model_type,scale_dtype", [("qwen3_next", torch.float32), ("qwen3_moe", torch.bfloat16)]
)
def test_fp8_checkpoint_matches_transformers_on_dequantised_weights(tmp_path, model_type, scale_dtype):
    hf = write_fp8_checkpoint(tmp_path, model_type, seed=21, scale_dtype=scale_dtype)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    for ids, out in zip(PROMPTS, generate(tmp_path / "fp8")):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        for pos in range(1, len(ids)):
            for tok, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(ref[pos - 1, tok])) < 1e-4, (pos, tok)
        assert out.token_ids == greedy[0, len(ids) :].tolist()


def logprobs(outs):
    return [[lp for pos in o.prompt_logprobs[1:] for lp in pos.values()] for o in outs]


def test_fp8_checkpoint_at_tp2_equals_tp1(tmp_path):
    write_fp8_checkpoint(tmp_path, "qwen3_next", seed=22, linear_num_key_heads=4, linear_num_value_heads=8)
    one, two = generate(tmp_path / "fp8"), generate(tmp_path / "fp8", tp=2)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    for a, b in zip(logprobs(one), logprobs(two)):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_fp8_experts_quantised_at_load_equal_their_dequantisation_quantised(tmp_path):
    """--quantize-experts nvfp4 from an FP8 checkpoint quantises the same fp32 values a float
    checkpoint of them gives: bit-identical results."""
    write_fp8_checkpoint(tmp_path, "qwen3_moe", seed=23)
    nvfp4 = dict(quantize_experts="nvfp4")
    a, b = generate(tmp_path / "fp8", **nvfp4), generate(tmp_path / "dequant", **nvfp4)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and logprobs(a) == logprobs(b)


@pytest.mark.parametrize(
    "change,says",
    [
        ("drop", r"missing tensor '.*experts\.2\.up_proj\.weight_scale_inv': .* declared fp8_block"),
        ("nan", r"experts\.2\.up_proj\.weight_scale_inv' in .*model\.safetensors: block scale \[0, 0\]"),
        ("shape", r"experts\.2\.up_proj\.weight_scale_inv' in .*: shape \[1, 1\], expected"),
    ],
)
def test_a_broken_fp8_scale_is_named_with_its_file(tmp_path, change, says):
    write_fp8_checkpoint(tmp_path, "qwen3_moe", seed=24)
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"
    if change == "drop":
        del tensors[name]
    elif change == "nan":
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    else:
        tensors[name] = torch.ones(1, 1)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=says):
        generate(tmp_path / "fp8")


@pytest.mark.parametrize("backend", ["offload", "cpu"])
def test_fp8_experts_in_the_host_store_equal_resident_ones(tmp_path, backend):
    """The offload / cpu backends fill their host store through the same loaders: the same
    dequantised experts, the same outputs as the resident bank."""
    write_fp8_checkpoint(tmp_path, "qwen3_next", seed=25)
    resident = generate(tmp_path / "fp8")
    hosted = generate(tmp_path / "fp8", moe_backend=backend, expert_cache_fraction=0.3)
    assert [o.token_ids for o in hosted] == [o.token_ids for o in resident]
    assert logprobs(hosted) == logprobs(resident)


def test_a_module_the_declaration_seems_to_quantise_loads_as_stored_in_float(tmp_path):
    """transformers reads ``modules_to_not_convert`` entries as name fragments ("mlp.gate" keeps
    every router in float), our patterns as globs: a float weight with no scale beside it is a
    module the tool left out, and loads as it is; one with a scale beside it is refused by name."""
    hf = write_fp8_checkpoint(tmp_path, "qwen3_moe", seed=26)
    config_path = tmp_path / "fp8" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.embed_tokens"]
    config_path.write_text(json.dumps(config))  # the routers now look quantised to our globs
    ids = PROMPTS[0]
    out = generate(tmp_path / "fp8")[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        for tok, lp in out.prompt_logprobs[pos].items():
            assert abs(lp - float(ref[pos - 1, tok])) < 1e-4
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.gate.weight_scale_inv"] = torch.ones(1, 2)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight' in .*: stored as torch\.float32 beside"):
        generate(tmp_path / "fp8")
