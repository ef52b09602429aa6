"""Small pieces of the qwen4_exp oracle: norms, RoPE, hyper-connections, MoE and PLE.

Each function is one equation of /work/shared/specs/qwen4_exp.md, written for clarity, not speed,
on float64 tensors of one request. It is not the engine and shares no code with `ft`; the engine is
tested against it. Weights are looked up by full checkpoint name with `get`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

Weights = Mapping[str, torch.Tensor]


def get(weights: Weights, name: str) -> torch.Tensor:
    """The tensor `name`, as float64 if it is floating point (integer tensors are kept as is)."""
    if name not in weights:
        raise KeyError(f"qwen4_exp reference: checkpoint has no tensor {name!r}")
    t = weights[name]
    return t.to(torch.float64) if t.is_floating_point() else t


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`nn.Linear` without bias: weight is `[out, in]`."""
    return x @ weight.T


# --- norms -----------------------------------------------------------------------------------


def rmsnorm_noweight(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm (the GDN output norm): the weight multiplies directly."""
    return rmsnorm_noweight(x, eps) * weight


def zc_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of Qwen3-Next: the stored weight `w` acts as `1 + w`."""
    return rmsnorm_noweight(x, eps) * (1.0 + weight)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the square root, added to the sum of squares, as HF qwen3_next's l2norm.
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# --- RoPE ------------------------------------------------------------------------------------


def partial_rope(x: torch.Tensor, theta: float, rot_dim: int) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first `rot_dim` dims of `x [T, heads, d]`; position = row."""
    T = x.shape[0]
    inv_freq = theta ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)  # [rot/2]
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, rot/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, rot]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * angles.cos() + rotated * angles.sin(), rest], dim=-1)


# --- hyper-connections (spec section 3) --------------------------------------------------------


def sinkhorn(A: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Spec's sinkhorn on `A [..., n, n]`; `P.sum(0)` of the spec is the column sum (dim -2)."""
    P = torch.softmax(A, dim=-1) + eps
    P = P / (P.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        P = P / (P.sum(-1, keepdim=True) + eps)
        P = P / (P.sum(-2, keepdim=True) + eps)
    return P


def hc_coefficients(
    weights: Weights, prefix: str, cfg: dict, X: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pre [T, n]`, `post [T, n]`, `C [T, n, n]` of one sublayer from streams `X [T, n, H]`."""
    T, n, H = X.shape
    eps = cfg["hc_eps"]
    fn, base, scale = (get(weights, f"{prefix}.{p}") for p in ("fn", "base", "scale"))
    z = rmsnorm_noweight(X.reshape(T, n * H), cfg["rms_norm_eps"])  # stream-major flatten
    m = linear(z, fn)  # [T, 2n + n*n]
    pre = torch.sigmoid(scale[0] * m[:, :n] + base[:n]) + eps
    post = 2.0 * torch.sigmoid(scale[1] * m[:, n : 2 * n] + base[n : 2 * n])
    logits_c = scale[2] * m[:, 2 * n :].reshape(T, n, n) + base[2 * n :].reshape(n, n)
    C = sinkhorn(logits_c, cfg["hc_sinkhorn_iters"], eps)
    return pre, post, C


def hc_sublayer(weights: Weights, prefix: str, cfg: dict, X: torch.Tensor, fn) -> torch.Tensor:
    """`X'[j] = post[j] * F(sum_i pre[i] X[i]) + sum_i C[i, j] X[i]` for every token."""
    pre, post, C = hc_coefficients(weights, prefix, cfg, X)
    x = torch.einsum("ti,tih->th", pre, X)  # [T, H]
    y = fn(x)  # [T, H]
    return post[:, :, None] * y[:, None, :] + torch.einsum("tij,tih->tjh", C, X)


def hc_head(weights: Weights, cfg: dict, X: torch.Tensor) -> torch.Tensor:
    """Collapse the streams `X [T, n, H]` after the last layer to `x [T, H]`."""
    T, n, H = X.shape
    z = rmsnorm_noweight(X.reshape(T, n * H), cfg["rms_norm_eps"])
    fn, base, scale = (get(weights, f"model.hc_head.{p}") for p in ("fn", "base", "scale"))
    pre = torch.sigmoid(scale[0] * linear(z, fn) + base) + cfg["hc_eps"]  # [T, n]
    return torch.einsum("ti,tih->th", pre, X)


# --- MoE (spec section 6) ----------------------------------------------------------------------


def moe(weights: Weights, prefix: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """Routed experts plus the sigmoid-gated shared expert, token by token."""
    probs = torch.softmax(linear(x, get(weights, f"{prefix}.gate.weight")), dim=-1)  # [T, E]
    top_p, top_e = torch.topk(probs, cfg["num_experts_per_tok"], dim=-1)  # [T, k]
    if cfg["norm_topk_prob"]:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for p, e in zip(top_p[t].tolist(), top_e[t].tolist()):
            ex = f"{prefix}.experts.{e}"
            gate = linear(x[t], get(weights, f"{ex}.gate_proj.weight"))
            up = linear(x[t], get(weights, f"{ex}.up_proj.weight"))
            y[t] += p * linear(F.silu(gate) * up, get(weights, f"{ex}.down_proj.weight"))
    Is = cfg["shared_expert_intermediate_size"]
    gate_up = linear(x, get(weights, f"{prefix}.shared_expert.gate_up_proj.weight"))  # [T, 2Is]
    gate, up = gate_up[:, :Is], gate_up[:, Is:]
    shared = linear(F.silu(gate) * up, get(weights, f"{prefix}.shared_expert.down_proj.weight"))
    shared_gate = torch.sigmoid(linear(x, get(weights, f"{prefix}.shared_expert_gate.weight")))
    return y + shared_gate * shared  # shared_gate [T, 1]


# --- PLE (spec section 7) ----------------------------------------------------------------------


def _wrap_int64(v: int) -> int:
    """Two's-complement int64 value of the Python int `v` (multiplication wraps mod 2^64)."""
    return (v + 2**63) % 2**64 - 2**63


def ple_rows(
    token_ids: list[int],
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    orders: list[int],
    pad_id: int,
) -> torch.Tensor:
    """Table rows `[U, T, O, heads]` (int64) for every PLE layer, order and head of one request.

    Python integers with explicit wrapping, so the hash does not rely on torch's overflow
    behaviour: signed int64 products, XOR of signed values, then a non-negative remainder.
    """
    U, O, heads = primes.shape
    prime_list = primes.reshape(-1).tolist()
    offsets = [sum(prime_list[:i]) for i in range(len(prime_list))]  # running sum in (u, o, j)
    mult = multipliers.tolist()
    rows = torch.empty(U, len(token_ids), O, heads, dtype=torch.int64)
    for u in range(U):
        for o, N in enumerate(orders):
            for t in range(len(token_ids)):
                mix = 0
                for i in range(N):
                    tok = token_ids[t - i] if t - i >= 0 else pad_id
                    mix ^= _wrap_int64(tok * mult[u][o][i])
                for j in range(heads):
                    flat = (u * O + o) * heads + j
                    rows[u, t, o, j] = offsets[flat] + mix % prime_list[flat]
    return rows


def ple(weights: Weights, cfg: dict, layer: int, x: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """`PLE_l(x) = sigmoid(<key_norm(key_proj e), query_norm(x)> / sqrt(H)) * value_proj e`."""
    T, H = x.shape
    eps = cfg["rms_norm_eps"]
    u = cfg["ple_layers"].index(layer)
    rows = ple_rows(
        token_ids,
        get(weights, "model.ple.multipliers"),
        get(weights, "model.ple.primes"),
        cfg["ple_ngram_orders"],
        cfg["ple_pad_id"],
    )[u]  # [T, O, heads]
    e = get(weights, "model.ple.table")[rows.reshape(T, -1)].reshape(T, -1)  # [T, De], (o, j)
    p = f"model.layers.{layer}.ple"
    key = linear(e, get(weights, f"{p}.key_proj.weight"))  # [T, H]
    key = zc_rmsnorm(key, get(weights, f"{p}.key_norm.weight"), eps)
    query = zc_rmsnorm(x, get(weights, f"{p}.query_norm.weight"), eps)
    s = (key * query).sum(-1, keepdim=True) * H**-0.5  # [T, 1]
    return torch.sigmoid(s) * linear(e, get(weights, f"{p}.value_proj.weight"))
