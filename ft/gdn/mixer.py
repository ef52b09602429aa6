"""The Gated DeltaNet mixer, after the input projection has produced its parts.

    qkv   = silu(causal_conv1d([q · k · v]))
    beta  = sigmoid(b);  g = -exp(A_log) · softplus(a + dt_bias)
    o     = gated_delta_rule(q, k, v, g, beta)              # per value head, fp32 state
    out   = out_proj(rmsnorm(o) · silu(z))

A backend with ``gated_delta_rule`` (fla) takes the conv output, b and a as they are and fuses the
gates into its kernels (a decode step is then one kernel); otherwise the gates are computed here
and the backend's ``delta_rule`` gets views of q, k, v.

Models differ only in how one projection packs q, k, v, z, b, a (Qwen3-Next groups them per key
head; qwen4_exp stores six contiguous parts), so they subclass this and define ``project``.
Conv channels, A_log and dt_bias follow their heads across ranks; the GDN norm is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ft.distributed import get_tp_info
from ft.forward_context import get_forward_context
from ft.gdn.snapshots import StateSnapshots, save_conv_snapshots
from ft.layers.linear import RowParallelLinear, parts_param, split_part
from ft.layers.norm import GatedRMSNorm
from ft.utils import div_even

try:  # a decode batch's conv as the input projection's epilogue (``triton_conv_proj.CONV_IN_PROJ``)
    from ft.gdn import triton_conv_proj
except ImportError:  # no triton (CPU-only installs)
    triton_conv_proj = None


class DepthwiseConv(nn.Module):
    """Holds ``weight [C_local, 1, Kc]`` whose channels are the [q | k | v] parts, each split by rank."""

    def __init__(self, parts, kernel_size: int) -> None:
        super().__init__()
        self.weight = parts_param(parts, 1, kernel_size)


class GatedDeltaNetMixer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.hk = div_even(num_k_heads, tp.size, "linear_num_key_heads over tp ranks")
        self.hv = div_even(num_v_heads, tp.size, "linear_num_value_heads over tp ranks")
        self.dk, self.dv, self.kc = head_k_dim, head_v_dim, conv_kernel
        key, value = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv1d = DepthwiseConv(
            [split_part(n, tp, "GDN conv channels") for n in (key, key, value)], conv_kernel
        )
        heads = [split_part(num_v_heads, tp, "GDN value heads")]
        self.A_log = parts_param(heads, dtype=torch.float32)
        self.dt_bias = parts_param(heads, dtype=torch.float32)
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowParallelLinear(value, hidden_size)
        self.conv_state: torch.Tensor | None = None  # [slots, C_local, Kc-1], bound by the runner
        self.ssm_state: torch.Tensor | None = None  # [slots, Hv_local, dk, dv] fp32

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        conv_channels = 2 * self.hk * self.dk + self.hv * self.dv
        return (conv_channels, self.kc - 1), (self.hv, self.dk, self.dv)

    def project(self, x: torch.Tensor, conv: bool = False):
        """x [T, H] -> the conv input [q | k | v] [T, 2·Hk·dk + Hv·dv] (heads in order), z [T, Hv, dv],
        b and a [T, Hv], for this rank's heads. Views of one projection's output where possible
        (``in_proj_output``; with ``conv`` the first part comes out convolved)."""
        raise NotImplementedError

    def in_proj_output(self, x: torch.Tensor, conv: bool = False) -> torch.Tensor:
        """``in_proj(x)``; with ``conv`` (``_conv_in_projection``) its conv channels come out as the
        conv's output, the sequences' histories shifted, from one launch (``triton_conv_proj``)."""
        if not conv:
            return self.in_proj(x)
        batch = get_forward_context().batch
        return triton_conv_proj.launch_proj_conv(
            x,
            self.in_proj.weight,
            self.conv1d.weight[:, 0],
            self.conv_state,
            batch.context_lens,
            batch.state_slots,
        )

    def _conv_in_projection(self, x: torch.Tensor, ctx) -> bool:
        """Whether the conv runs as the input projection's epilogue (``triton_conv_proj.CONV_IN_PROJ``):
        a backend whose decode conv is that epilogue's twin, one token a sequence, no snapshots to
        save from the conv input, a projection the GEMV takes."""
        return (
            triton_conv_proj is not None
            and triton_conv_proj.CONV_IN_PROJ
            and getattr(ctx.gdn, "folds_decode_conv", False)
            and ctx.batch.snapshots is None
            and len(x) == ctx.batch.cu_seqlens.shape[0] - 1
            and ctx.batch.is_decode_only
            and self.in_proj.bias is None
            and triton_conv_proj.takes(x, self.in_proj.weight)
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        ctx = get_forward_context()
        convolved = self._conv_in_projection(x, ctx)
        qkv, z, b, a = self.project(x, convolved)
        snaps = ctx.batch.snapshots
        if snaps is not None:  # before the conv moves the slots' history past the points
            save_conv_snapshots(qkv, self.conv_state, ctx.batch, snaps)
        mixed = qkv if convolved else ctx.gdn.conv(qkv, self.conv1d.weight[:, 0], self.conv_state, ctx.batch)
        if snaps is None:
            o = self._delta(ctx.gdn, mixed, b, a, ctx.batch)
        else:
            o = self._delta_with_snapshots(ctx.gdn, mixed, b, a, snaps)
        o = o.reshape(t, self.hv, self.dv)
        return self.out_proj(self.norm(o, z).view(t, -1))  # z stays a strided view

    def _delta(self, gdn, mixed, b, a, batch) -> torch.Tensor:
        if hasattr(gdn, "gated_delta_rule"):  # the backend fuses the gates and the q/k/v split in
            return gdn.gated_delta_rule(mixed, b, a, self.A_log, self.dt_bias, self.ssm_state, batch)
        return self._gated_delta_rule(gdn, mixed, b, a, batch)

    def _delta_with_snapshots(self, gdn, mixed, b, a, snaps: StateSnapshots) -> torch.Tensor:
        """The delta rule in two passes (``ft.gdn.snapshots``): the heads leave the states at the
        points in their slots, copied to the snapshot rows; the tails continue from there."""
        o = mixed.new_empty(mixed.shape[0], self.hv, self.dv)
        for part, index in ((snaps.head, snaps.head_index), (snaps.tail, snaps.tail_index)):
            if part is None:
                continue
            o[index] = self._delta(gdn, mixed[index], b[index], a[index], part)
            if part is snaps.head:
                self.ssm_state[snaps.rows] = self.ssm_state[part.state_slots]
        return o

    def _gated_delta_rule(self, gdn, mixed, b, a, batch) -> torch.Tensor:
        """The gates in torch, then the backend's ``delta_rule`` on views of the conv output."""
        t, key = mixed.shape[0], self.hk * self.dk
        q, k, v = mixed.split([key, key, self.hv * self.dv], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return gdn.delta_rule(
            q.view(t, self.hk, self.dk),
            k.view(t, self.hk, self.dk),
            v.reshape(t, self.hv, self.dv),
            g,
            beta,
            self.ssm_state,
            batch,
        )
