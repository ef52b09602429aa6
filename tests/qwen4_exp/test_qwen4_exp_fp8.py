"""Block-FP8 dense projections: the format's reference, the column/row-parallel layers under TP
splits that cut through scale blocks, ``dense_quant_mode``'s start-up refusals, and a qwen4_exp
checkpoint with fp8_block dense weights (bf16 experts) against the oracle run on the dequantised
weights at TP 1 and 2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ft.distributed import TPInfo, tp_context
from ft.engine.build import build_model
from ft.layers.linear import heads_part
from ft.models.checkpoint import CheckpointTensor
from ft.models.config_json import config_from_dict
from ft.quant import nvfp4
from ft.quant.declaration import parse_declaration
from ft.quant.dense import dense_quant_mode
from ft.quant.fp8_block import (
    Fp8BlockColumnParallelLinear,
    Fp8BlockRowParallelLinear,
    dequantize_fp8_block,
    quantize_fp8_block,
)
from tests.qwen4_exp.conftest import PROMPTS, generate, greedy, prompt_gaps
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint
from tests.reference.qwen4_exp_ref import reference_logits

FP8_DECLARATION = {
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
    "ignored_layers": [
        "lm_head",
        "model.layers.*.mlp.gate",
        "model.layers.*.mlp.shared_expert_gate",
        "model.layers.*.mlp.experts.*",
    ],
}


def load_into(module, file: str, prefix: str) -> None:
    with safe_open(file, "pt") as handle:
        for leaf in ("weight", "weight_scale_inv"):
            param = getattr(module, leaf)
            param.weight_loader(param, CheckpointTensor(f"{prefix}.{leaf}", file, handle), None)


def test_quantize_round_trip_and_block_layout():
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 10, 24)
    q, s = quantize_fp8_block(w, (16, 16))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    back = dequantize_fp8_block(q, s, (16, 16))
    assert ((back - w).abs() <= w.abs() * 2**-3 + 1e-6).all()  # e4m3 keeps 3 mantissa bits
    assert float(back[16:32, :16].abs().max()) == pytest.approx(float(w[16:32, :16].abs().max()), rel=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_fp8_layers_slice_scales_exactly(tmp_path, tp):
    gen = torch.Generator().manual_seed(tp)
    block, inputs = (16, 16), 40  # 40 columns: the last k-block is partial, TP=4 cuts blocks
    parts_rows = (48, 24, 24)  # three fused parts of 8, 4, 4 heads of 6 rows: ranks cut row blocks
    fused = torch.randn(sum(parts_rows), inputs, generator=gen)
    down = torch.randn(24, inputs, generator=gen)
    tensors = {}
    for name, w in (("col", fused), ("row", down)):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = quantize_fp8_block(w, block)
    file = str(tmp_path / "fp8.safetensors")
    save_file(tensors, file)
    col_full = dequantize_fp8_block(tensors["col.weight"], tensors["col.weight_scale_inv"], block)
    row_full = dequantize_fp8_block(tensors["row.weight"], tensors["row.weight_scale_inv"], block)
    x = torch.randn(5, inputs, generator=gen, dtype=torch.float64)
    col_pieces, row_sum = [[], [], []], torch.zeros(5, 24, dtype=torch.float64)
    for r in range(tp):
        with tp_context(TPInfo(r, tp)):
            parts = [heads_part(n // 6, 6, TPInfo(r, tp), "heads") for n in parts_rows]
            col = Fp8BlockColumnParallelLinear(inputs, parts, block)
            row = Fp8BlockRowParallelLinear(inputs, 24, block)
        load_into(col, file, "col")
        load_into(row, file, "row")
        local = col.dequantized(torch.float64)
        for i, piece in enumerate(local.split(col.output_sizes)):
            col_pieces[i].append(piece)
        torch.testing.assert_close(col(x), x @ local.T)
        width = inputs // tp
        row_sum += row.partial(x[:, r * width : (r + 1) * width])
    bounds = torch.tensor([0, *parts_rows]).cumsum(0).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        torch.testing.assert_close(torch.cat(col_pieces[i]), col_full[a:b].double(), atol=0, rtol=0)
    torch.testing.assert_close(row_sum, x @ row_full.double().T)


def test_dense_quant_mode_decides_and_refuses_by_name():
    fp8 = parse_declaration(FP8_DECLARATION, None)
    assert dense_quant_mode(fp8, "model.layers.1.self_attn.qkv_proj") == "fp8_block"  # no engine needed
    assert dense_quant_mode(fp8, "model.layers.1.mlp.gate") == "bf16"
    nvfp4 = parse_declaration(
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}, None
    )
    with tp_context(TPInfo(0, 2)):  # built in float, its NVFP4 tensors dequantised as they load
        assert dense_quant_mode(nvfp4, "model.layers.0.linear_attn.in_proj") == "bf16"
    half = parse_declaration(FP8_DECLARATION | {"ignored_layers": ["model.layers.*.self_attn.k_proj"]}, None)
    with pytest.raises(ValueError, match="qkv_proj.*block-FP8 needs them all"):
        dense_quant_mode(half, "model.layers.1.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))
    bad = parse_declaration(FP8_DECLARATION | {"weight_block_size": [128]}, None)
    with pytest.raises(ValueError, match="weight_block_size"):
        dense_quant_mode(bad, "model.layers.1.self_attn.o_proj")


def test_nvfp4_dense_modules_build_in_float_and_are_noted_for_the_loader():
    raw = tiny_qwen4_exp_config() | {"ple_table_rows": 546}
    raw["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "ignore": ["lm_head", "*.mlp.gate", "*.self_attn.*"],
    }
    model = build_model(config_from_dict(raw), TPInfo(0, 1), "meta", torch.float32)
    noted = model.dequantized
    assert noted["model.layers.0.linear_attn.in_proj"].format == "nvfp4"
    assert noted["model.layers.0.linear_attn.out_proj"].format == "nvfp4"
    assert not any(".self_attn." in m or m.endswith("mlp.gate") or ".experts." in m for m in noted)
    assert model.get_submodule("model.layers.0.linear_attn.in_proj").weight.dtype == torch.float32


def test_a_block_fp8_router_or_lm_head_has_no_twin_and_loads_dequantised():
    raw = tiny_qwen4_exp_config() | {"ple_table_rows": 546}
    experts_only = ["model.layers.*.mlp.experts.*"]
    raw["quantization_config"] = FP8_DECLARATION | {"ignored_layers": experts_only}
    model = build_model(config_from_dict(raw), TPInfo(0, 1), "meta", torch.float32)
    noted = model.dequantized
    assert noted["lm_head"].format == noted["model.layers.0.mlp.gate"].format == "fp8_block"
    assert noted["model.layers.0.mlp.shared_expert_gate"].block == (128, 128)
    assert not any("proj" in m for m in noted)  # the projections are block-FP8 twins
    assert model.get_submodule("model.layers.0.mlp.gate").weight.dtype == torch.float32


def is_dense_linear(name: str, tensor: torch.Tensor) -> bool:
    skip = ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate", "mlp.experts.")
    return name.endswith(".weight") and tensor.dim() == 2 and not any(s in name for s in skip)


def fp8_dense(name: str, w: torch.Tensor, tensors: dict) -> torch.Tensor:
    """Store ``name`` as block-FP8 in ``tensors``; its dequantisation in fp64."""
    q, s = quantize_fp8_block(w, (128, 128))
    tensors[name], tensors[name + "_scale_inv"] = q, s
    return dequantize_fp8_block(q, s, (128, 128), torch.float64)


def nvfp4_dense(name: str, w: torch.Tensor, tensors: dict) -> torch.Tensor:
    """Store ``name`` as NVFP4 in the ModelOpt layout in ``tensors``; its dequantisation in fp64."""
    q, stem = nvfp4.quantize(w), name.removesuffix(".weight")
    tensors[name], tensors[f"{stem}.weight_scale"] = q.weight, q.weight_scale
    tensors[f"{stem}.weight_scale_2"] = q.weight_scale_2.clone()
    return q.dequantize(torch.float64)


NVFP4_DECLARATION = {  # routed experts excluded: bf16, or quantised at load
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "ignore": ["lm_head", "model.embed_tokens", "*.mlp.gate", "*.mlp.shared_expert_gate", "*.mlp.experts*"],
}
DENSE = {"fp8_block": (fp8_dense, FP8_DECLARATION), "nvfp4": (nvfp4_dense, NVFP4_DECLARATION)}


@pytest.mark.parametrize("dense,experts", [("fp8_block", "bf16"), ("fp8_block", "nvfp4"), ("nvfp4", "bf16")])
def test_quantised_dense_checkpoint_matches_the_oracle_on_dequantised_weights(tmp_path, dense, experts):
    """Dense weights block-FP8 (kept so, in twins) or NVFP4 (the spec's third dense format, loaded
    dequantised); routed experts bf16, or NVFP4 (the bank quantises them on load)."""
    config = tiny_qwen4_exp_config()
    tensors = write_qwen4_exp_checkpoint(tmp_path, config, seed=7)
    dequantised = dict(tensors)
    store, declaration = DENSE[dense]
    quantised = 0
    for name, w in list(tensors.items()):
        if is_dense_linear(name, w):
            dequantised[name] = store(name, w, tensors)
            quantised += 1
        elif experts == "nvfp4" and ".mlp.experts." in name:
            dequantised[name] = nvfp4.quantize(w).dequantize(torch.float64)
    assert quantised == 2 * 2 + 2 * 5 + 4 * 2 + 2 * 2  # GDN 2, QSA 5 (3 indexer), shared 2, PLE 2
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": declaration}))
    params = greedy(3, prompt_logprobs=0)
    options = {"quantize_experts": "nvfp4"} if experts == "nvfp4" else {}
    for tp in (1, 2):
        out = generate(tmp_path, PROMPTS[:1], params, tp_size=tp, **options)[0]
        ref = torch.log_softmax(reference_logits(dequantised, config, PROMPTS[0] + out.token_ids), dim=-1)
        assert prompt_gaps(out, ref).max() < 1e-4, f"tp {tp}"
        assert out.token_ids == ref[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
