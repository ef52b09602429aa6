"""qwen4_exp's Gated DeltaNet (spec section 4): Qwen3-Next's mixer with a six-part ``in_proj``.

``in_proj.weight`` stacks six contiguous parts, q (Hk·dk) · k (Hk·dk) · v (Hv·dv) · z (Hv·dv) ·
b (Hv) · a (Hv), each head-major, so a rank's heads are one row range of each part: the linear
is column-parallel with six parts split by heads. The conv channels, A_log and dt_bias follow
their heads in ``GatedDeltaNetMixer``; the recurrence and its caches are the mixer's.
"""

from __future__ import annotations

import torch

from ft.distributed import get_tp_info
from ft.gdn.mixer import GatedDeltaNetMixer
from ft.layers.linear import ColumnParallelLinear, heads_part
from ft.models.config import ModelConfig


class Qwen4ExpGatedDeltaNet(GatedDeltaNetMixer):
    def __init__(self, cfg: ModelConfig) -> None:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        super().__init__(cfg.hidden_size, hk, hv, dk, dv, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        tp = get_tp_info()
        parts = (
            heads_part(hk, dk, tp, "in_proj q (linear_num_key_heads)"),
            heads_part(hk, dk, tp, "in_proj k (linear_num_key_heads)"),
            heads_part(hv, dv, tp, "in_proj v (linear_num_value_heads)"),
            heads_part(hv, dv, tp, "in_proj z (linear_num_value_heads)"),
            heads_part(hv, 1, tp, "in_proj b (linear_num_value_heads)"),
            heads_part(hv, 1, tp, "in_proj a (linear_num_value_heads)"),
        )
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, (), parts=parts)

    def project(self, x: torch.Tensor, conv: bool = False):
        q, k, v, z, b, a = self.in_proj.output_sizes
        qkv, z, b, a = self.in_proj_output(x, conv).split([q + k + v, z, b, a], dim=-1)
        return qkv, z.view(x.shape[0], self.hv, self.dv), b, a
