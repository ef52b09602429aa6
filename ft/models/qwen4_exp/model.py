"""qwen4_exp ("Qwen3.8-Flash-Next"), per shared/specs/qwen4_exp.md: Qwen3-Next plus QSA sparse
attention, PLE n-gram embeddings and hyper-connections.

    X = n copies of embed(x)                                  # [T, n, H] residual streams
    for each layer l:
        X = hc_mixer_l(X, x -> Mixer_l(input_layernorm(x + PLE_l(x))))   # GDN or QSA
        X = hc_moe_l(X, x -> MoE_l(post_attention_layernorm(x)))
    logits = lm_head(norm(hc_head(X)))

Every projection that is fused in the checkpoint (qkv_proj, in_proj, shared_expert.gate_up_proj)
is fused on disk too: each loads with ``shard_id=None`` and its column-parallel parts narrow it.
The exception is the router, whose weight also holds the shared expert's gate (``ft.moe.router``):
``packed_modules`` maps ``mlp.gate`` and ``mlp.shared_expert_gate`` onto it. Dense projections
may be block-FP8 (``ft.quant.dense``).
"""

from __future__ import annotations

import torch
from torch import nn

from ft.forward_context import get_forward_context
from ft.layers.embedding import VocabParallelEmbedding
from ft.layers.norm import RMSNorm
from ft.models.config import ModelConfig
from ft.models.decoder import MIXER_NAMES, CausalLM
from ft.models.qwen3_moe import mlp
from ft.models.qwen4_exp.gdn import Qwen4ExpGatedDeltaNet
from ft.models.qwen4_exp.hyper import HyperHead, residual
from ft.models.qwen4_exp.ple import PLELayer, PLETable
from ft.models.qwen4_exp.qsa import QSAAttention
from ft.moe.block import SHARED_GATE_PACKING
from ft.quant.dense import dequantize_experts, quantize_dense_linears


class Qwen4ExpLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        kind = cfg.layer_types[index]
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mixer_name = MIXER_NAMES[kind]
        mixer = QSAAttention(cfg) if kind == "full_attention" else Qwen4ExpGatedDeltaNet(cfg)
        self.add_module(self.mixer_name, mixer)
        self.mlp = mlp(cfg, index)
        self.input_layernorm = RMSNorm(h, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centered=True)
        embed_dim = len(cfg.ple_ngram_orders) * cfg.ple_heads * cfg.ple_head_dim
        self.ple = PLELayer(h, embed_dim, eps) if index in cfg.ple_layers else None
        hc = (cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.hc_mixer, self.hc_moe = residual(*hc), residual(*hc)

    def forward(self, positions: torch.Tensor, X: torch.Tensor, ple: torch.Tensor | None) -> torch.Tensor:
        """X [T, n, H]; ``ple`` is this layer's n-gram embedding [T, De] when it is a PLE layer."""
        mixer = getattr(self, self.mixer_name)

        def mix(x: torch.Tensor) -> torch.Tensor:
            if self.ple is not None:
                x = x + self.ple(x, ple)
            return mixer(positions, self.input_layernorm(x))

        X = self.hc_mixer(X, mix)
        return self.hc_moe(X, lambda x: self.mlp(self.post_attention_layernorm(x)))


class Qwen4ExpModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n = cfg.hc_mult
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.ple = PLETable(cfg) if cfg.ple_layers else None
        self.ple_index = {layer: u for u, layer in enumerate(cfg.ple_layers)}
        self.layers = nn.ModuleList(Qwen4ExpLayer(cfg, i) for i in range(cfg.num_layers))
        self.hc_head = (
            HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps) if cfg.hc_mult > 1 else None
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # all PLE rows of the step, gathered ahead of the layers that read them: [U, T, De]
        ple = self.ple(input_ids, get_forward_context().batch) if self.ple is not None else None
        X = self.embed_tokens(input_ids)[:, None, :].expand(-1, self.n, -1)  # [T, n, H]
        for i, layer in enumerate(self.layers):
            u = self.ple_index.get(i)
            X = layer(positions, X, None if u is None else ple[u])
        x = self.hc_head(X) if self.hc_head is not None else X[:, 0]
        return self.norm(x)


class Qwen4ExpForCausalLM(CausalLM):
    packed_modules: dict[str, tuple[str, ...]] = {}  # fused on disk too, but for the router below

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.shared_expert_intermediate_size:
            self.packed_modules = SHARED_GATE_PACKING
        quantize_dense_linears(self, cfg.quantization)
        dequantize_experts(self, cfg.quantization)

    def make_model(self, cfg: ModelConfig) -> nn.Module:
        return Qwen4ExpModel(cfg)
