"""Qwen3-Next (the Qwen3-Next-80B-A3B family): Gated DeltaNet layers and output-gated full
attention, zero-centred RMSNorm, routed experts plus a sigmoid-gated shared expert.

Its GDN projections are grouped per key head: ``in_proj_qkvz`` rows are, for each key head,
[q (dk) | k (dk) | v (r·dv) | z (r·dv)] with r = Hv/Hk value heads per key head, and
``in_proj_ba`` rows are [b (r) | a (r)] per key head. Splitting by key heads is therefore a
contiguous row range per rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ft.gdn.mixer import GatedDeltaNetMixer
from ft.layers.linear import ColumnParallelLinear
from ft.models.config import ModelConfig
from ft.models.decoder import CausalLM, DecoderLayer
from ft.models.qwen3_moe import attention, mlp


class Qwen3NextGatedDeltaNet(GatedDeltaNetMixer):
    def __init__(self, cfg: ModelConfig) -> None:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        super().__init__(cfg.hidden_size, hk, hv, dk, dv, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        self.ratio = hv // hk
        self.in_proj_qkvz = ColumnParallelLinear(cfg.hidden_size, [hk * (2 * dk + 2 * self.ratio * dv)])
        self.in_proj_ba = ColumnParallelLinear(cfg.hidden_size, [hk * 2 * self.ratio])

    def project(self, x: torch.Tensor):
        t, r, dk, dv = x.shape[0], self.ratio, self.dk, self.dv
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        return (
            q,
            k,
            v.reshape(t, self.hv, dv),
            z.reshape(t, self.hv, dv),
            b.reshape(t, self.hv),
            a.reshape(t, self.hv),
        )


class Qwen3NextForCausalLM(CausalLM):
    ignored_checkpoint_tensors = (r"^mtp\.",)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        kind = cfg.layer_types[index]
        mixer = attention(cfg) if kind == "full_attention" else Qwen3NextGatedDeltaNet(cfg)
        return DecoderLayer(cfg, kind, mixer, mlp(cfg, index))
