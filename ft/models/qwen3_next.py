"""Qwen3-Next (the Qwen3-Next-80B-A3B family): Gated DeltaNet layers and output-gated full
attention, zero-centred RMSNorm, routed experts plus a sigmoid-gated shared expert.

Its GDN projections are grouped per key head on disk: ``in_proj_qkvz`` rows are, for each key
head, [q (dk) | k (dk) | v (r·dv) | z (r·dv)] with r = Hv/Hk value heads per key head, and
``in_proj_ba`` rows are [b (r) | a (r)] per key head. Both load into one fused ``in_proj`` (one
GEMM per step instead of two): a rank's key heads are one contiguous row range of each, which
the loader reorders part-major, ``[q | k | v | z | b | a]`` with heads in order, so the
projection's output splits into the conv input, z, b and a by views, with no gathers per step.
Likewise ``mlp.gate`` and ``mlp.shared_expert_gate`` load into one router weight (``ft.moe.router``).
"""

from __future__ import annotations

import torch
from torch import nn

from ft.distributed import get_tp_info
from ft.gdn.mixer import GatedDeltaNetMixer
from ft.layers.linear import ColumnParallelLinear, Part, split_part
from ft.models.checkpoint import FLOAT_DTYPES, CheckpointTensor
from ft.models.config import ModelConfig
from ft.models.decoder import CausalLM, DecoderLayer
from ft.models.qwen3_moe import attention, mlp
from ft.moe.block import SHARED_GATE_PACKING
from ft.quant.dense import dequantize_dense, dequantize_experts


class Qwen3NextGatedDeltaNet(GatedDeltaNetMixer):
    def __init__(self, cfg: ModelConfig) -> None:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        super().__init__(cfg.hidden_size, hk, hv, dk, dv, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        r, tp = hv // hk, get_tp_info()
        qkvz = split_part(hk * (2 * dk + 2 * r * dv), tp, "GDN key heads")  # whole key heads per rank
        ba = split_part(hk * 2 * r, tp, "GDN key heads")
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, [], parts=(qkvz, ba))
        self.in_proj.weight.weight_loader = PartLoaders(
            [GroupedLoader(qkvz, [dk, dk, r * dv, r * dv]), GroupedLoader(ba, [r, r], offset=qkvz.local)]
        )

    def project(self, x: torch.Tensor, conv: bool = False):
        t, value = x.shape[0], self.hv * self.dv
        sizes = [2 * self.hk * self.dk + value, value, self.hv, self.hv]
        qkv, z, b, a = self.in_proj_output(x, conv).split(sizes, dim=-1)
        return qkv, z.view(t, self.hv, self.dv), b, a


class GroupedLoader:
    """Loads this rank's key-head groups of a per-key-head grouped tensor, reordered part-major,
    into rows ``[offset, offset + part.local)`` of the parameter: rows [g0: w0 w1 .. | g1: w0 w1 ..]
    on disk become [w0 of g0, g1, .. | w1 of g0, g1, .. | ..]."""

    def __init__(self, part: Part, widths: list[int], offset: int = 0) -> None:
        self.part, self.widths, self.offset = part, widths, offset

    def __call__(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
        hidden = param.shape[1]
        ckpt.expect_shape((self.part.size, hidden))
        ckpt.expect_dtype(FLOAT_DTYPES)
        rows = ckpt.narrow(0, self.part.start, self.part.local).view(-1, sum(self.widths), hidden)
        grouped = torch.cat([w.reshape(-1, hidden) for w in rows.split(self.widths, dim=1)])
        param.data.narrow(0, self.offset, self.part.local).copy_(grouped)


class PartLoaders:
    """Loads a fused parameter whose checkpoint parts (``packed_modules``) each have their loader."""

    def __init__(self, loaders: list) -> None:
        self.loaders = loaders

    def __call__(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError(f"{ckpt.name}: this fused projection loads from its parts, not one tensor")
        self.loaders[shard_id](param, ckpt)


class Qwen3NextForCausalLM(CausalLM):
    packed_modules = CausalLM.packed_modules | {"in_proj": ("in_proj_qkvz", "in_proj_ba")}
    ignored_checkpoint_tensors = (r"^mtp\.",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.shared_expert_intermediate_size:
            self.packed_modules = self.packed_modules | SHARED_GATE_PACKING
        dequantize_dense(self, cfg.quantization)
        dequantize_experts(self, cfg.quantization)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        kind = cfg.layer_types[index]
        mixer = attention(cfg) if kind == "full_attention" else Qwen3NextGatedDeltaNet(cfg)
        return DecoderLayer(cfg, kind, mixer, mlp(cfg, index))
