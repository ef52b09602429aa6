"""Tiny ModelOpt NVFP4 checkpoints for tests, with the bf16 source and a dequantised twin.

From one random transformers checkpoint (``tests.checkpoints``) this writes three directories:

- ``bf16``: the source, its up projections scaled by 3 so that gate and up of one expert get
  different globals (the per-row bookkeeping must be right, not merely lucky);
- ``nvfp4``: every routed expert projection quantised with ``ft.quant.nvfp4.quantize`` and stored
  as ModelOpt does (``weight`` uint8, ``weight_scale`` float8_e4m3fn, ``weight_scale_2`` and
  ``input_scale`` fp32 scalars), declared in ``hf_quant_config.json`` or in config.json's
  ``quantization_config``, with exclude patterns for everything else (attention, GDN, router,
  shared expert, dense MLPs, embeddings, lm_head stay as they were);
- ``dequant``: the same model with each quantised projection replaced by its dequantisation,
  which transformers loads as the fp32 oracle.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ft.quant import nvfp4
from tests.checkpoints import write_checkpoint

EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
DENSE_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
EXCLUDE = [
    "lm_head",
    "model.embed_tokens",
    "model.layers.*.self_attn*",
    "model.layers.*.linear_attn*",
    "model.layers.*.mlp.gate",
    "model.layers.*.mlp.shared_expert*",
]
UP_SCALE = 3.0


def _write(dst: Path, src: Path, tensors: dict[str, torch.Tensor]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    save_file(tensors, str(dst / "model.safetensors"))


def _declare(path: Path, declare: str, exclude: list[str]) -> None:
    if declare == "hf_quant_config":
        body = {
            "producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude},
        }
        (path / "hf_quant_config.json").write_text(json.dumps(body, indent=2))
    elif declare == "config":
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "ignore": exclude,
        }
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        raise ValueError(declare)


def _quantised(name: str, w: torch.Tensor, dense: bool) -> bool:
    """Whether the checkpoint stores ``name`` as NVFP4: a routed expert's projection, and with
    ``dense`` every other linear weight too (attention, GDN, shared expert, dense MLP, router,
    shared-expert gate, lm_head) whose input is a whole number of 16-wide blocks, as ModelOpt's
    default recipe leaves only what its patterns exclude."""
    if EXPERT.match(name):
        return True
    linear = name.endswith(".weight") and w.dim() == 2 and "embed_tokens" not in name
    return dense and linear and w.shape[1] % nvfp4.BLOCK == 0


def write_nvfp4_checkpoint(
    root: Path, model_type: str, seed: int = 0, declare: str = "hf_quant_config", dense: bool = False,
    **overrides,
):  # fmt: skip
    """Write ``root/{bf16,nvfp4,dequant}``; returns transformers' fp32 model on the dequantised
    weights. ``dense``: the dense linears are NVFP4 too, everything else excluded by name."""
    from transformers import AutoModelForCausalLM

    src = root / "bf16"
    write_checkpoint(src, model_type, seed, **overrides)
    source = load_file(str(src / "model.safetensors"))
    for name in source:
        if EXPERT.match(name) and ".up_proj." in name:
            source[name] = source[name] * UP_SCALE
    save_file(source, str(src / "model.safetensors"))

    gen = torch.Generator().manual_seed(seed)
    packed, dequant = {}, {}
    kept = ["model.embed_tokens"]
    for name, w in source.items():
        if not _quantised(name, w, dense):
            packed[name] = dequant[name] = w
            if w.dim() == 2 and name.endswith(".weight"):
                kept.append(name.removesuffix(".weight"))
            continue
        q = nvfp4.quantize(w)
        stem = name.removesuffix(".weight")
        packed[f"{stem}.weight"] = q.weight
        packed[f"{stem}.weight_scale"] = q.weight_scale
        packed[f"{stem}.weight_scale_2"] = q.weight_scale_2.clone()
        packed[f"{stem}.input_scale"] = torch.rand((), generator=gen) + 0.01
        dequant[name] = q.dequantize(w.dtype)
    _write(root / "nvfp4", src, packed)
    if dense:
        _declare(root / "nvfp4", declare, kept)
    else:
        mlp_only = sorted({m.group(1) for m in map(DENSE_MLP.match, source) if m})
        _declare(root / "nvfp4", declare, EXCLUDE + [f"model.layers.{i}.mlp*" for i in mlp_only])
    _write(root / "dequant", src, dequant)
    return AutoModelForCausalLM.from_pretrained(str(root / "dequant"), dtype=torch.float32).eval()
