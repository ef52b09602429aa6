"""Plain-PyTorch oracle for the `qwen4_exp` model family: full forward of one request, float64.

Written from /work/shared/specs/qwen4_exp.md alone and deliberately slow: every call recomputes
all positions from the token ids (no KV, conv or recurrent cache, no batching, no tensor
parallelism, no quantised weights). The engine in `ft/` is tested against it; nothing here
imports `ft`. Checkpoints with NVFP4 / fp8 tensors must be dequantised before they reach here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from .qwen4_exp_mixers import gdn_mixer, qsa_mixer
from .qwen4_exp_parts import Weights, get, hc_head, hc_sublayer, linear, moe, ple, zc_rmsnorm


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """`config.json` and every `*.safetensors` of a directory; floating tensors as float64."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    assert files, f"no *.safetensors in {path}"
    for file in files:
        for name, tensor in load_file(file).items():
            assert name not in weights, f"tensor {name!r} appears twice (again in {file.name})"
            weights[name] = tensor.to(torch.float64) if tensor.is_floating_point() else tensor
    return weights, config


def mixer_sublayer(
    weights: Weights,
    cfg: dict,
    layer: int,
    x: torch.Tensor,
    token_ids: list[int],
    qsa_dense: bool = False,
) -> torch.Tensor:
    """`F_mixer(x) = Mixer_l(input_layernorm(x + PLE_l(x)))`; x is the (pre-mixed) input [T, H]."""
    p = f"model.layers.{layer}"
    if layer in cfg.get("ple_layers", []):
        x = x + ple(weights, cfg, layer, x, token_ids)
    h = zc_rmsnorm(x, get(weights, f"{p}.input_layernorm.weight"), cfg["rms_norm_eps"])
    kind = cfg["layer_types"][layer]
    if kind == "linear_attention":
        return gdn_mixer(weights, f"{p}.linear_attn", cfg, h)
    assert kind == "full_attention", f"layer_types[{layer}] = {kind!r} is not a known mixer"
    return qsa_mixer(weights, f"{p}.self_attn", cfg, h, dense=qsa_dense)


def moe_sublayer(weights: Weights, cfg: dict, layer: int, x: torch.Tensor) -> torch.Tensor:
    """`F_moe(x) = MoE_l(post_attention_layernorm(x))`."""
    p = f"model.layers.{layer}"
    h = zc_rmsnorm(x, get(weights, f"{p}.post_attention_layernorm.weight"), cfg["rms_norm_eps"])
    return moe(weights, f"{p}.mlp", cfg, h)


def final_logits(weights: Weights, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """`lm_head(norm(x))`, with the embedding as head when `tie_word_embeddings`."""
    h = zc_rmsnorm(x, get(weights, "model.norm.weight"), cfg["rms_norm_eps"])
    tied = cfg.get("tie_word_embeddings", False)
    head = get(weights, "model.embed_tokens.weight" if tied else "lm_head.weight")
    return linear(h, head)  # [T, vocab]


def reference_logits(
    weights: Weights, config: dict, token_ids: list[int], qsa_dense: bool = False
) -> torch.Tensor:
    """float64 logits `[T, vocab]` of one request. `qsa_dense` replaces QSA by dense attention."""
    cfg = config
    assert len(cfg["layer_types"]) == cfg["num_hidden_layers"], "layer_types needs one per layer"
    token_ids = [int(t) for t in token_ids]
    n = cfg.get("hc_mult", 1)
    e = get(weights, "model.embed_tokens.weight")[token_ids]  # [T, H]

    def sublayers(layer: int) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
        return [
            ("hc_mixer", lambda x: mixer_sublayer(weights, cfg, layer, x, token_ids, qsa_dense)),
            ("hc_moe", lambda x: moe_sublayer(weights, cfg, layer, x)),
        ]

    if n == 1:  # plain pre-norm residuals
        h = e
        for layer in range(cfg["num_hidden_layers"]):
            for _, f in sublayers(layer):
                h = h + f(h)
        return final_logits(weights, cfg, h)

    X = e[:, None, :].repeat(1, n, 1)  # [T, n, H]: n copies of e_t
    for layer in range(cfg["num_hidden_layers"]):
        for name, f in sublayers(layer):
            X = hc_sublayer(weights, f"model.layers.{layer}.{name}", cfg, X, f)
    return final_logits(weights, cfg, hc_head(weights, cfg, X))


def reference_greedy(weights: Weights, config: dict, prompt_ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens (argmax, lowest id on ties), recomputing the full forward each step."""
    ids = [int(t) for t in prompt_ids]
    out: list[int] = []
    for _ in range(n):
        nxt = int(torch.argmax(reference_logits(weights, config, ids + out)[-1]))
        out.append(nxt)
    return out
