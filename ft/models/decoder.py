"""The decoder skeleton shared by the Qwen MoE families: embedding, pre-norm layers, final norm,
lm_head. A model file says which mixer and MLP each layer gets; this file says how they stack.

    h = h + mixer(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))

Checkpoint-to-module mapping is data on the class: ``packed_modules`` names the checkpoint
tensors that a fused module loads part by part; ``ignored_checkpoint_tensors`` are patterns the
loader skips (e.g. multi-token-prediction heads we do not run).
"""

from __future__ import annotations

import torch
from torch import nn

from ft.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ft.layers.norm import RMSNorm
from ft.models.config import ModelConfig

MIXER_NAMES = {"full_attention": "self_attn", "linear_attention": "linear_attn"}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.mixer_name = MIXER_NAMES[layer_type]
        self.add_module(self.mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + getattr(self, self.mixer_name)(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class CausalLM(nn.Module):
    packed_modules: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    ignored_checkpoint_tensors: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.make_model(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.ignored_checkpoint_tensors = (*self.ignored_checkpoint_tensors, r"^lm_head\.weight$")

    def make_model(self, cfg: ModelConfig) -> nn.Module:
        """The stack under ``self.model``: embedding, layers, final norm (a family may wrap it)."""
        return DecoderModel(cfg, [self.make_layer(cfg, i) for i in range(cfg.num_layers)])

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, H] for the flattened batch."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
