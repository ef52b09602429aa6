"""Tiny random Hugging Face checkpoints for tests, every parameter randomised.

transformers initialises norms to zero / one, A_log to a fixed range and routers to small
values; a test that kept those would not notice a missing ``1 +`` or a wrong head order. Here
every parameter is drawn afresh, then the model is saved with ``save_pretrained`` in the hub
layout (per-expert tensors), exactly as real checkpoints are.
"""

from __future__ import annotations

import torch

QWEN3_NEXT_BASE = dict(
    vocab_size=96,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    layer_types=["linear_attention", "full_attention"] * 2,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

QWEN3_MOE_BASE = dict(
    vocab_size=96,
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=32,
    rope_theta=10000.0,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    mlp_only_layers=[],
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, scale: float = 1.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        fan_in = p.shape[-1] if p.dim() >= 2 else 1
        std = 0.2 if p.dim() < 2 else scale * fan_in**-0.5
        value = torch.randn(p.shape, generator=gen) * std
        if name.endswith("A_log"):
            value = torch.rand(p.shape, generator=gen) * 2.5 - 1.0
        elif name.endswith("dt_bias"):
            value = torch.randn(p.shape, generator=gen) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            value = 1.0 + torch.randn(p.shape, generator=gen) * 0.2
        elif "layernorm" in name or name.endswith("norm.weight"):
            value = torch.randn(p.shape, generator=gen) * 0.2 + (0.0 if _zero_centred(model) else 1.0)
        p.copy_(value)


def _zero_centred(model) -> bool:
    return model.config.model_type == "qwen3_next"


def make_hf_model(model_type: str, seed: int = 0, weight_scale: float = 1.2, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    if model_type == "qwen3_next":
        cfg = Qwen3NextConfig(**(QWEN3_NEXT_BASE | overrides))
        model = Qwen3NextForCausalLM(cfg)
    elif model_type == "qwen3_moe":
        cfg = Qwen3MoeConfig(**(QWEN3_MOE_BASE | overrides))
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(model_type)
    model = model.float().eval()
    randomize(model, seed, weight_scale)
    return model


def write_checkpoint(path, model_type: str, seed: int = 0, weight_scale: float = 1.2, **overrides):
    """Save a random model under ``path``; returns the transformers model (fp32, eval).

    ``weight_scale`` sets matrix weights to that many times fan_in^-0.5: the default makes
    activations grow layer by layer (so mistakes show); bf16 comparisons want a calmer model."""
    model = make_hf_model(model_type, seed, weight_scale, **overrides)
    model.save_pretrained(str(path))
    return model


def family_checkpoints(seed: int, **options):
    """A module-scoped fixture: ``write_checkpoint`` of each model family (qwen3_next, qwen3_moe)
    into its own directory, with ``seed`` and ``options``."""
    import pytest

    @pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
    def ckpt(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        write_checkpoint(path, request.param, seed=seed, **options)
        return path

    return ckpt
