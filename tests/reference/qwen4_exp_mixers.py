"""The two token mixers of the qwen4_exp oracle: Gated DeltaNet and QSA sparse attention.

Straight from sections 4 and 5 of /work/shared/specs/qwen4_exp.md, float64, one request, every
position computed from scratch (no cache). The GDN recurrence runs token by token and QSA builds
an explicit `[T, T]` key mask from the block selection, so both are slow and easy to check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .qwen4_exp_parts import Weights, get, l2norm, linear, partial_rope, rmsnorm, zc_rmsnorm

# --- Gated DeltaNet (spec section 4) -----------------------------------------------------------


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`out[t, c] = sum_i weight[c, 0, i] * x[t - (Kc-1) + i, c]`, zero before the request."""
    T, C = x.shape
    Kc = weight.shape[-1]
    padded = torch.cat([torch.zeros(Kc - 1, C, dtype=x.dtype), x])  # [Kc-1+T, C]
    return sum(weight[:, 0, i] * padded[i : i + T] for i in range(Kc))


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """`S_t = e^g S + beta k (v - e^g S^T k)^T`, `o_t = S_t^T q_t`, per head from `S = 0`.

    q, k `[T, Hv, dk]` (already one per value head), v `[T, Hv, dv]`, g, beta `[T, Hv]`.
    """
    T, Hv, dk = k.shape
    S = torch.zeros(Hv, dk, v.shape[-1], dtype=torch.float64)
    o = torch.empty_like(v)
    for t in range(T):
        for j in range(Hv):
            decayed = torch.exp(g[t, j]) * S[j]  # [dk, dv]
            S[j] = decayed + beta[t, j] * torch.outer(k[t, j], v[t, j] - decayed.T @ k[t, j])
            o[t, j] = S[j].T @ q[t, j]
    return o


def gdn_mixer(weights: Weights, prefix: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet on the normed layer input `x [T, H]`."""
    T = x.shape[0]
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    assert Hv % Hk == 0, f"linear_num_value_heads {Hv} not a multiple of linear_num_key_heads {Hk}"
    proj = linear(x, get(weights, f"{prefix}.in_proj.weight"))
    q, k, v, z, b, a = proj.split([Hk * dk, Hk * dk, Hv * dv, Hv * dv, Hv, Hv], dim=-1)
    qkv = F.silu(causal_depthwise_conv(torch.cat([q, k, v], -1), get(weights, f"{prefix}.conv1d.weight")))
    q, k, v = qkv.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q = l2norm(q.reshape(T, Hk, dk)) * dk**-0.5
    k = l2norm(k.reshape(T, Hk, dk))
    v = v.reshape(T, Hv, dv)
    beta = torch.sigmoid(b)  # [T, Hv]
    A_log, dt_bias = get(weights, f"{prefix}.A_log"), get(weights, f"{prefix}.dt_bias")
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)  # [T, Hv]

    group = Hv // Hk  # value head j reads key head j // group
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # [T, Hv, dk]
    o = gated_delta_rule(q, k, v, g, beta)  # [T, Hv, dv]

    normed = rmsnorm(o, get(weights, f"{prefix}.norm.weight"), cfg["rms_norm_eps"])  # per head
    gated = normed * F.silu(z.reshape(T, Hv, dv))
    return linear(gated.reshape(T, Hv * dv), get(weights, f"{prefix}.out_proj.weight"))


# --- QSA (spec section 5) ----------------------------------------------------------------------


def qsa_block_scores(weights: Weights, prefix: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """Indexer scores `[T, T // B]` of every query against every complete block."""
    T = x.shape[0]
    Hi, di, B = cfg["qsa_index_heads"], cfg["qsa_index_head_dim"], cfg["qsa_block_size"]
    p = f"{prefix}.indexer"
    qI = linear(x, get(weights, f"{p}.q_proj.weight")).reshape(T, Hi, di)
    kI = linear(x, get(weights, f"{p}.k_proj.weight"))  # [T, di]
    kI = zc_rmsnorm(kI, get(weights, f"{p}.k_norm.weight"), cfg["rms_norm_eps"])
    w = linear(x, get(weights, f"{p}.w_proj.weight")) * (Hi * di) ** -0.5  # [T, Hi]
    n_complete = T // B
    kbar = kI[: n_complete * B].reshape(n_complete, B, di).mean(1)  # [nb, di]
    dots = torch.einsum("tjd,bd->tjb", qI, kbar)  # [T, Hi, nb]
    return torch.einsum("tj,tjb->tb", w, torch.relu(dots))


def qsa_selected_blocks(scores: torch.Tensor, c: int, local_blocks: int, topk: int) -> list[int]:
    """Sorted blocks a query in block `c` attends to; `scores[b]` must exist for all `b < c`.

    Block 0, the local window `c-Lc+1 .. c`, and the `topk` best remaining blocks `b < c`
    (ties to the lower block index).
    """
    assert local_blocks >= 1, f"qsa_local_blocks {local_blocks} must be >= 1 (own block)"
    chosen = {0} | set(range(max(0, c - local_blocks + 1), c + 1))
    rest = [b for b in range(c) if b not in chosen]
    rest.sort(key=lambda b: (-float(scores[b]), b))
    return sorted(chosen | set(rest[:topk]))


def qsa_selections(weights: Weights, prefix: str, cfg: dict, x: torch.Tensor) -> list[list[int]]:
    """The selected blocks of every query position of the request."""
    scores = qsa_block_scores(weights, prefix, cfg, x)
    B = cfg["qsa_block_size"]
    return [
        qsa_selected_blocks(scores[t], t // B, cfg["qsa_local_blocks"], cfg["qsa_topk_blocks"])
        for t in range(x.shape[0])
    ]


def qsa_key_mask(weights: Weights, prefix: str, cfg: dict, x: torch.Tensor, dense: bool) -> torch.Tensor:
    """`[T, T]` bool: query t may read key s (causal, and s's block selected unless dense)."""
    T = x.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if dense:
        return mask
    B = cfg["qsa_block_size"]
    for t, blocks in enumerate(qsa_selections(weights, prefix, cfg, x)):
        for s in range(t + 1):
            mask[t, s] = (s // B) in blocks
    return mask


def qsa_mixer(weights: Weights, prefix: str, cfg: dict, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """Gated QSA attention on the normed layer input `x [T, H]`; `dense` skips the selection."""
    T = x.shape[0]
    Hq, Hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert Hq % Hkv == 0, f"num_attention_heads {Hq} not a multiple of num_key_value_heads {Hkv}"
    eps = cfg["rms_norm_eps"]
    proj = linear(x, get(weights, f"{prefix}.qkv_proj.weight"))
    q_gate, k, v = proj.split([2 * Hq * d, Hkv * d, Hkv * d], dim=-1)
    q_gate = q_gate.reshape(T, Hq, 2, d)  # per query head: q_h rows, then gate_h rows
    q, gate = q_gate[:, :, 0], q_gate[:, :, 1]  # [T, Hq, d]
    k, v = k.reshape(T, Hkv, d), v.reshape(T, Hkv, d)
    q = zc_rmsnorm(q, get(weights, f"{prefix}.q_norm.weight"), eps)
    k = zc_rmsnorm(k, get(weights, f"{prefix}.k_norm.weight"), eps)
    rot_dim = int(d * cfg["partial_rotary_factor"])
    q, k = partial_rope(q, cfg["rope_theta"], rot_dim), partial_rope(k, cfg["rope_theta"], rot_dim)

    group = Hq // Hkv  # query head h reads kv head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, Hq, d]
    logits = torch.einsum("thd,shd->hts", q, k) * d**-0.5  # [Hq, T, T]
    mask = qsa_key_mask(weights, prefix, cfg, x, dense)
    logits = logits.masked_fill(~mask, float("-inf"))
    attn = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1), v)  # [T, Hq, d]
    out = attn * torch.sigmoid(gate)
    return linear(out.reshape(T, Hq * d), get(weights, f"{prefix}.o_proj.weight"))
