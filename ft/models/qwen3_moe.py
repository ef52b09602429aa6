"""Qwen3-MoE (the Qwen3-30B-A3B family): QK-normed GQA attention and top-k routed experts.

Layers listed in ``mlp_only_layers`` (or off the ``decoder_sparse_step``) get a dense SwiGLU MLP.
"""

from __future__ import annotations

from torch import nn

from ft.layers.attention import QKNormAttention
from ft.models.config import ModelConfig
from ft.models.decoder import CausalLM, DecoderLayer
from ft.moe.block import GatedMLP, SparseMoeBlock
from ft.quant.dense import dequantize_dense, dequantize_experts


def attention(cfg: ModelConfig) -> QKNormAttention:
    return QKNormAttention(
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rotary_dim,
        cfg.rope_theta,
        cfg.rms_norm_eps,
        cfg.zero_centered_norm,
        cfg.attn_output_gate,
        cfg.attention_bias,
    )


def mlp(cfg: ModelConfig, index: int) -> nn.Module:
    if cfg.mlp_types[index] == "dense":
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
    return SparseMoeBlock(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.norm_topk_prob,
        cfg.shared_expert_intermediate_size,
        expert_format=cfg.expert_format,
        checkpoint_format=cfg.quantization.format_of(f"model.layers.{index}.mlp.experts.0.gate_proj"),
    )


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        dequantize_dense(self, cfg.quantization)
        dequantize_experts(self, cfg.quantization)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, "full_attention", attention(cfg), mlp(cfg, index))
