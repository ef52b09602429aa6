"""Reference Gated DeltaNet in plain PyTorch: token-by-token recurrence in fp32, per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.forward_context import ForwardBatch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_sequence(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [T, Hv, dk] (already normalised and scaled), v [T, Hv, dv], g/beta [T, Hv],
    state [Hv, dk, dv] fp32. Returns (o [T, Hv, dv] fp32, final state)."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


class TorchGDN:
    name = "torch"

    def conv(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch):
        kc = weight.shape[-1]
        out = torch.empty_like(x)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            slot = int(batch.state_slots[i])
            seq = x[start : start + qlen].t()  # [C, q]
            hist = conv_state[slot] if ctx > 0 else torch.zeros_like(conv_state[slot])
            full = torch.cat([hist.to(seq.dtype), seq], dim=-1)  # [C, Kc-1+q]
            y = F.conv1d(full[None].float(), weight.float()[:, None, :], groups=weight.shape[0])[0]
            out[start : start + qlen] = F.silu(y).t().to(x.dtype)
            conv_state[slot] = full[:, -(kc - 1) :].to(conv_state.dtype)
            start += qlen
        return out

    def delta_rule(self, q, k, v, g, beta, ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rep = v.shape[1] // q.shape[1]
        qf = l2norm(q.float()).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
        kf = l2norm(k.float()).repeat_interleave(rep, dim=1)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            slot = int(batch.state_slots[i])
            s = slice(start, start + qlen)
            init = ssm_state[slot] if ctx > 0 else torch.zeros_like(ssm_state[slot])
            o, final = delta_rule_sequence(
                qf[s], kf[s], v[s].float(), g[s].float(), beta[s].float(), init.float()
            )
            out[s] = o.to(v.dtype)
            ssm_state[slot] = final
            start += qlen
        return out
