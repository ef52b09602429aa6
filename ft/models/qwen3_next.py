"""Qwen3-Next (the Qwen3-Next-80B-A3B family): Gated DeltaNet layers and output-gated full
attention, zero-centred RMSNorm, routed experts plus a sigmoid-gated shared expert.

Its GDN projections are grouped per key head on disk: ``in_proj_qkvz`` rows are, for each key
head, [q (dk) | k (dk) | v (r·dv) | z (r·dv)] with r = Hv/Hk value heads per key head, and
``in_proj_ba`` rows are [b (r) | a (r)] per key head. A rank's key heads are one contiguous row
range; the loader reorders that range part-major ([q | k | v | z], [b | a], heads in order) so the
projection's output splits into the conv input and z by views, with no gathers per step.
"""

from __future__ import annotations

import torch
from torch import nn

from ft.gdn.mixer import GatedDeltaNetMixer
from ft.layers.linear import ColumnParallelLinear, Part
from ft.models.checkpoint import FLOAT_DTYPES, CheckpointTensor
from ft.models.config import ModelConfig
from ft.models.decoder import CausalLM, DecoderLayer
from ft.models.qwen3_moe import attention, mlp


class Qwen3NextGatedDeltaNet(GatedDeltaNetMixer):
    def __init__(self, cfg: ModelConfig) -> None:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        super().__init__(cfg.hidden_size, hk, hv, dk, dv, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        r = hv // hk
        self.in_proj_qkvz = ColumnParallelLinear(cfg.hidden_size, [hk * (2 * dk + 2 * r * dv)])
        self.in_proj_ba = ColumnParallelLinear(cfg.hidden_size, [hk * 2 * r])
        self.in_proj_qkvz.weight.weight_loader = GroupedLoader(
            self.in_proj_qkvz.parts[0], [dk, dk, r * dv, r * dv]
        )
        self.in_proj_ba.weight.weight_loader = GroupedLoader(self.in_proj_ba.parts[0], [r, r])

    def project(self, x: torch.Tensor):
        t, value = x.shape[0], self.hv * self.dv
        qkv, z = self.in_proj_qkvz(x).split([2 * self.hk * self.dk + value, value], dim=-1)
        b, a = self.in_proj_ba(x).split([self.hv, self.hv], dim=-1)
        return qkv, z.view(t, self.hv, self.dv), b, a


class GroupedLoader:
    """Loads this rank's key-head groups of a per-key-head grouped tensor, reordered part-major:
    rows [g0: w0 w1 .. | g1: w0 w1 ..] on disk become [w0 of g0, g1, .. | w1 of g0, g1, .. | ..]."""

    def __init__(self, part: Part, widths: list[int]) -> None:
        self.part, self.widths = part, widths

    def __call__(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
        hidden = param.shape[1]
        ckpt.expect_shape((self.part.size, hidden))
        ckpt.expect_dtype(FLOAT_DTYPES)
        rows = ckpt.narrow(0, self.part.start, self.part.local).view(-1, sum(self.widths), hidden)
        param.data.copy_(torch.cat([w.reshape(-1, hidden) for w in rows.split(self.widths, dim=1)]))


class Qwen3NextForCausalLM(CausalLM):
    ignored_checkpoint_tensors = (r"^mtp\.",)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        kind = cfg.layer_types[index]
        mixer = attention(cfg) if kind == "full_attention" else Qwen3NextGatedDeltaNet(cfg)
        return DecoderLayer(cfg, kind, mixer, mlp(cfg, index))
