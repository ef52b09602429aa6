"""Full attention with per-head q/k RMSNorm (Qwen3), optionally output-gated (Qwen3-Next).

    [q | gate], k, v = qkv_proj(x);  q, k = rope(q_norm(q), k_norm(k))
    out = o_proj(attention(q, k, v) * sigmoid(gate))        # gate only when output_gate

With ``output_gate`` each query head's rows are [q_h, gate_h] in the projection, and the head
split keeps them together. The attention backend comes from the forward context, and the layer
hands it the raw q/k/v heads with the work around the attention core (``QKNormGate``: the norms
and rope before, the gate after), so that a backend can fuse that work into a decode step's
kernels (``ft.attention.triton_paged.FUSED_DECODE``) without the layer knowing the cache. Done
apart, on a GPU the norms and rope are one Triton kernel reading q and k from the projection by
strides, and the gate another (``ft.layers.triton_rope``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """x, gate [T, H, d] -> x · sigmoid(gate) [T, H, d], sigmoid rounded to x's dtype before the
    product."""
    if x.is_cuda and fused_sigmoid_gate is not None:
        return fused_sigmoid_gate(x, gate)
    # contiguous rows: torch's CPU sigmoid on the strided view rounds differently with the batch shape
    t = x.shape[0]
    return (x.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))).view(x.shape)


@dataclass(frozen=True)
class QKNormGate:
    """What a QK-normed layer does around the attention core, for the backend to apply or fuse:

        q, k = rope(q_norm(q)), rope(k_norm(k))      before (``norm_rope``)
        out  = out · sigmoid(gate)                   after (``apply_gate``; nothing when gate is None)

    A backend that fuses reads the parts (norm weights, ``rotary.inv_freq``, the gate view) itself.
    """

    positions: torch.Tensor  # [T]
    rotary: RotaryEmbedding
    q_norm: RMSNorm
    k_norm: RMSNorm
    gate: torch.Tensor | None  # [T, Hq, d], a strided view of the projection

    def __post_init__(self) -> None:
        q, k = self.q_norm, self.k_norm
        assert (q.eps, q.zero_centered) == (k.eps, k.zero_centered), (
            "q_norm and k_norm must share eps and zero-centring"
        )

    def norm_rope(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.norm_and_rotate(self.positions, q, k, self.q_norm, self.k_norm)

    def apply_gate(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.gate is None else sigmoid_gate(out, self.gate)


class QKNormAttention(nn.Module):
    max_keys: int | None = None  # every earlier key (causal); sparse variants attend fewer

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

    def decode_cache_reads(self, context: int) -> int:
        """Cache elements a decode query of a sequence with ``context`` cached tokens must read
        (the decode roofline, ``ft.bench.roofline``): every earlier key and value."""
        h, d = self.cache_shape()
        return 2 * h * d * context

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        heads = q.view(t, self.num_heads, -1)  # [T, Hq, d], or [T, Hq, 2d] rows [q_h | gate_h]
        q, k, v = heads[..., :d], k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        gate = heads[..., d:] if self.output_gate else None
        around = QKNormGate(positions, self.rotary, self.q_norm, self.k_norm, gate)
        out = self.attend(x, q, k, v, around)  # [T, Hq, d]
        return self.o_proj(out.reshape(t, self.num_heads * d))

    def attend(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, around: QKNormGate
    ) -> torch.Tensor:
        """``around`` applied to the raw heads q [T, Hq, d], k, v [T, Hkv, d] and causal attention
        over the cache after storing k, v: here by the backend, which may fuse ``around`` into a
        decode step's kernels. Variants whose key selection reads the layer input ``x`` (qwen4_exp's
        QSA) override it."""
        ctx = get_forward_context()
        return ctx.attention.forward(q, k, v, self.kv_cache, ctx.batch, self.scale, around)
