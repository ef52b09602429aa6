"""The decoder skeleton shared by the Qwen MoE families: embedding, pre-norm layers, final norm,
lm_head. A model file says which mixer and MLP each layer gets; this file says how they stack.

    h = h + mixer(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))

Each add is fused with the norm after it (one kernel on a GPU), so a layer carries the residual
stream ``r`` apart from the sublayer output ``x`` that is not yet added to it:

    a, r = input_layernorm(x + r)           # the first layer: a = input_layernorm(r), r = embedding
    a, r = post_attention_layernorm(mixer(a) + r)
    x    = mlp(a)                           # -> (x, r) to the next layer; the final norm adds it

The sums are rounded as the unfused adds round them, so the numbers are those of the first form.

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
from ft.quant.declaration import KV_SCALES

MIXER_NAMES = {"full_attention": "self_attn", "linear_attention": "linear_attn"}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.mixer_name = MIXER_NAMES[layer_type]
        self.add_module(self.mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]: the previous layer's MLP output, or the embedding when ``residual`` is None
        (the first layer). Returns (this layer's MLP output, the residual stream it is not yet added to)."""
        if residual is None:
            a, residual = self.input_layernorm(x), x
        else:
            a, residual = self.input_layernorm(x, residual)
        lookahead = getattr(self.mlp, "lookahead", None)
        if lookahead is not None:  # an MLP that can use its input's guess before the mixer runs
            lookahead(residual, self.post_attention_layernorm)
        a, residual = self.post_attention_layernorm(getattr(self, self.mixer_name)(positions, a), residual)
        return self.mlp(a), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


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
        if cfg.quantization.kv_cache:  # a quantised KV cache declared: the cache stays in our dtype
            self.ignored_checkpoint_tensors = (*self.ignored_checkpoint_tensors, KV_SCALES)

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
