"""Full attention with per-head q/k RMSNorm (Qwen3), optionally output-gated (Qwen3-Next).

    [q | gate], k, v = qkv_proj(x);  q, k = rope(q_norm(q), k_norm(k))
    out = o_proj(attention(q, k, v) * sigmoid(gate))        # gate only when output_gate

With ``output_gate`` each query head's rows are [q_h, gate_h] in the projection, and the head
split keeps them together. The attention kernel comes from the forward context; on a GPU the
norms and rope are one Triton kernel reading q and k from the projection by strides, and the
gate another (``ft.layers.triton_rope``).
"""

from __future__ import annotations

import torch
from torch import nn

from ft.forward_context import get_forward_context
from ft.layers.linear import QKVParallelLinear, RowParallelLinear
from ft.layers.norm import RMSNorm
from ft.layers.rotary import RotaryEmbedding

try:  # out · sigmoid(gate) in one kernel, reading the gate from the projection; for GPU tensors
    from ft.layers.triton_rope import sigmoid_gate as fused_sigmoid_gate
except ImportError:  # no triton (CPU-only installs)
    fused_sigmoid_gate = None


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [T, H, d] -> x · sigmoid(gate) [T, H·d], sigmoid rounded to x's dtype before the
    product."""
    t = x.shape[0]
    if x.is_cuda and fused_sigmoid_gate is not None:
        return fused_sigmoid_gate(x, gate).view(t, -1)
    # contiguous rows: torch's CPU sigmoid on the strided view rounds differently with the batch shape
    return x.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))


class QKNormAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        rope_theta: float,
        eps: float,
        zero_centered_norm: bool,
        output_gate: bool,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim, self.output_gate = head_dim, output_gate
        q_rows = 2 * head_dim if output_gate else head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, q_rows, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.rotary = RotaryEmbedding(head_dim, rotary_dim, rope_theta)
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None  # [2, blocks, block_size, kv_heads, d], bound by the runner

    def cache_shape(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        heads = q.view(t, self.num_heads, -1)  # [T, Hq, d], or [T, Hq, 2d] rows [q_h | gate_h]
        q, k = self.rotary.norm_and_rotate(
            positions, heads[..., :d], k.view(t, self.num_kv_heads, d), self.q_norm, self.k_norm
        )
        out = self.attend(x, q, k, v.view(t, self.num_kv_heads, d))  # [T, Hq, d]
        if self.output_gate:
            out = sigmoid_gate(out, heads[..., d:])
        return self.o_proj(out.reshape(t, self.num_heads * d))

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [T, Hq, d] over the cache after storing k, v [T, Hkv, d]. ``x`` is
        the layer input, for variants whose key selection reads it (qwen4_exp's QSA)."""
        ctx = get_forward_context()
        return ctx.attention.forward(q, k, v, self.kv_cache, ctx.batch, self.scale)
