"""Tiny random `qwen4_exp` checkpoints for CPU tests: a config and a safetensors writer.

Every tensor is named and shaped as in the tables of /work/shared/specs/qwen4_exp.md and every
parameter is random (norm weights too), so a swapped or misread tensor changes the logits.
Linear weights have std 1/sqrt(fan_in) so activations stay O(1) through the layers. Not a
quantised checkpoint: NVFP4 / fp8 variants are the engine tests' business.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def tiny_qwen4_exp_config(**overrides) -> dict:
    """A small but complete config: GDN and QSA layers, MoE, hyper-connections and PLE."""
    config = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "qsa_block_size": 4,
        "qsa_topk_blocks": 2,
        "qsa_local_blocks": 2,
        "qsa_index_heads": 2,
        "qsa_index_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": 32,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "hc_eps": 1e-6,
        "ple_layers": [0, 2],
        "ple_ngram_orders": [2, 3],
        "ple_heads": 2,
        "ple_head_dim": 8,
        "ple_pad_id": 0,
    }
    unknown = set(overrides) - set(config)
    assert not unknown, f"unknown qwen4_exp config fields {sorted(unknown)}"
    config.update(overrides)
    return config


def default_ple_primes(config: dict, start: int = 53) -> torch.Tensor:
    """Distinct primes `>= start`, int64 `[len(ple_layers), len(ple_ngram_orders), ple_heads]`."""
    shape = (len(config["ple_layers"]), len(config["ple_ngram_orders"]), config["ple_heads"])
    primes: list[int] = []
    candidate = start
    while len(primes) < shape[0] * shape[1] * shape[2]:
        if candidate > 1 and all(candidate % p for p in range(2, int(candidate**0.5) + 1)):
            primes.append(candidate)
        candidate += 1
    return torch.tensor(primes, dtype=torch.int64).reshape(shape)


def _tensor_plan(config: dict, n_table_rows: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, init kind) for every tensor of the checkpoint, following the spec tables."""
    c = config
    H, V, n = c["hidden_size"], c["vocab_size"], c.get("hc_mult", 1)
    plan: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((V, H), "embed")}
    if not c.get("tie_word_embeddings", False):
        plan["lm_head.weight"] = ((V, H), "linear")
    plan["model.norm.weight"] = ((H,), "zc_norm")
    if n > 1:
        plan["model.hc_head.fn"] = ((n, n * H), "linear")
        plan["model.hc_head.base"] = ((n,), "hc_base")
        plan["model.hc_head.scale"] = ((1,), "hc_scale")
    ple_layers = c.get("ple_layers", [])
    De = len(c["ple_ngram_orders"]) * c["ple_heads"] * c["ple_head_dim"] if ple_layers else 0
    if ple_layers:
        plan["model.ple.table"] = ((n_table_rows, c["ple_head_dim"]), "embed")

    Hk, Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, Kc = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    Hq, Hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    Hi, di = c["qsa_index_heads"], c["qsa_index_head_dim"]
    E, I, Is = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    for layer, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{layer}"
        plan[f"{p}.input_layernorm.weight"] = ((H,), "zc_norm")
        plan[f"{p}.post_attention_layernorm.weight"] = ((H,), "zc_norm")
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            plan[f"{a}.in_proj.weight"] = ((2 * Hk * dk + 2 * Hv * dv + 2 * Hv, H), "linear")
            plan[f"{a}.conv1d.weight"] = ((2 * Hk * dk + Hv * dv, 1, Kc), "linear")
            plan[f"{a}.A_log"] = ((Hv,), "a_log")
            plan[f"{a}.dt_bias"] = ((Hv,), "dt_bias")
            plan[f"{a}.norm.weight"] = ((dv,), "plain_norm")
            plan[f"{a}.out_proj.weight"] = ((H, Hv * dv), "linear")
        else:
            a = f"{p}.self_attn"
            plan[f"{a}.qkv_proj.weight"] = ((2 * Hq * d + 2 * Hkv * d, H), "linear")
            plan[f"{a}.q_norm.weight"] = ((d,), "zc_norm")
            plan[f"{a}.k_norm.weight"] = ((d,), "zc_norm")
            plan[f"{a}.o_proj.weight"] = ((H, Hq * d), "linear")
            plan[f"{a}.indexer.q_proj.weight"] = ((Hi * di, H), "linear")
            plan[f"{a}.indexer.k_proj.weight"] = ((di, H), "linear")
            plan[f"{a}.indexer.k_norm.weight"] = ((di,), "zc_norm")
            plan[f"{a}.indexer.w_proj.weight"] = ((Hi, H), "linear")
        m = f"{p}.mlp"
        plan[f"{m}.gate.weight"] = ((E, H), "linear")
        for e in range(E):
            plan[f"{m}.experts.{e}.gate_proj.weight"] = ((I, H), "linear")
            plan[f"{m}.experts.{e}.up_proj.weight"] = ((I, H), "linear")
            plan[f"{m}.experts.{e}.down_proj.weight"] = ((H, I), "linear")
        plan[f"{m}.shared_expert.gate_up_proj.weight"] = ((2 * Is, H), "linear")
        plan[f"{m}.shared_expert.down_proj.weight"] = ((H, Is), "linear")
        plan[f"{m}.shared_expert_gate.weight"] = ((1, H), "linear")
        if n > 1:
            for s in ("hc_mixer", "hc_moe"):
                plan[f"{p}.{s}.fn"] = ((2 * n + n * n, n * H), "linear")
                plan[f"{p}.{s}.base"] = ((2 * n + n * n,), "hc_base")
                plan[f"{p}.{s}.scale"] = ((3,), "hc_scale")
        if layer in ple_layers:
            plan[f"{p}.ple.key_proj.weight"] = ((H, De), "linear")
            plan[f"{p}.ple.value_proj.weight"] = ((H, De), "linear")
            plan[f"{p}.ple.key_norm.weight"] = ((H,), "zc_norm")
            plan[f"{p}.ple.query_norm.weight"] = ((H,), "zc_norm")
    return plan


def _random(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    normal = torch.randn(shape, generator=gen, dtype=torch.float64)
    uniform = torch.rand(shape, generator=gen, dtype=torch.float64)
    if kind == "linear":
        return normal * shape[-1] ** -0.5
    return {
        "embed": normal,
        "zc_norm": 0.1 * normal,  # stored w, acts as 1 + w
        "plain_norm": 1.0 + 0.1 * normal,
        "a_log": uniform * 2.0 - 1.0,  # decay rates exp(A_log) in [0.37, 2.7]
        "dt_bias": 0.5 * normal,
        "hc_base": 0.5 * normal,
        "hc_scale": 0.5 + uniform,
    }[kind]


def write_qwen4_exp_checkpoint(
    path: str | Path,
    config: dict,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    ple_primes: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Write `config.json` and `model.safetensors` into `path`; returns the tensors written.

    Floating tensors are stored as `dtype`; `model.ple.multipliers` (random odd values in
    [2^61, 2^63)) and `model.ple.primes` (`ple_primes`, default `default_ple_primes`) as int64.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    n_rows = 0
    if config.get("ple_layers", []):
        primes = default_ple_primes(config) if ple_primes is None else ple_primes.to(torch.int64)
        U, O, heads = len(config["ple_layers"]), len(config["ple_ngram_orders"]), config["ple_heads"]
        assert tuple(primes.shape) == (U, O, heads), f"ple primes {tuple(primes.shape)} != {(U, O, heads)}"
        n_rows = int(primes.sum())
        shape = (U, O, max(config["ple_ngram_orders"]))
        multipliers = torch.randint(2**61, 2**63 - 1, shape, generator=gen, dtype=torch.int64) | 1
        tensors["model.ple.multipliers"] = multipliers
        tensors["model.ple.primes"] = primes.clone()
    for name, (shape, kind) in _tensor_plan(config, n_rows).items():
        tensors[name] = _random(shape, kind, gen).to(dtype).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def qwen4_exp_tensor_shapes(config: dict, ple_primes: torch.Tensor | None = None) -> dict[str, tuple]:
    """name -> shape of every tensor a (non-quantised) checkpoint of `config` holds."""
    shapes: dict[str, tuple] = {}
    n_rows = 0
    if config.get("ple_layers", []):
        primes = default_ple_primes(config) if ple_primes is None else ple_primes
        n_rows = int(primes.sum())
        shapes["model.ple.multipliers"] = (*primes.shape[:2], max(config["ple_ngram_orders"]))
        shapes["model.ple.primes"] = tuple(primes.shape)
    shapes.update({name: shape for name, (shape, _) in _tensor_plan(config, n_rows).items()})
    return shapes
