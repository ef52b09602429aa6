"""Gated DeltaNet in Triton where many tiny kernels would cost more than the maths: decode, and the
gates of the chunked path.

``gdn_recurrent`` is a whole decode step (B sequences of one token), or a batch of short
sequences, in one launch. A program owns one (sequence, value head h, BV columns of the state)
and computes in fp32, for each of its sequence's tokens in order

    beta = sigmoid(b);  g = -exp(A_log) · softplus(a + dt_bias)
    q = q / sqrt(|q|² + 1e-6) · dk^-0.5;  k = k / sqrt(|k|² + 1e-6)     (key head h // (Hv/Hk))
    S = exp(g) · S;  u = beta · (v − Sᵀk);  S = S + k uᵀ;  o = Sᵀq

where S = ``ssm_state[slot, h]`` ([dk, dv] fp32) is read once and written once, in place; a
sequence with no context starts from zeros without reading its slot. q, k, v come straight from
the conv output and b, a from their projection views, by strides: nothing is copied, gathered
or scattered around the kernel. Padded rows of a CUDA-graph batch (the scratch slot, context 0)
are ordinary fresh rows; a row with a negative slot touches no state and gets o = 0.

``gdn_gates`` computes g and beta [T, Hv] in fp32 in one launch for the chunked (prefill) path.

Not a general recurrence: a program walks its sequence token by token, which suits decode and
sequences of a few tokens (``fla_backend.RECURRENT_MAX_TOKENS``), not prefill; dk and dv up to 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.forward_context import ForwardBatch
from ft.layers.pdl import pdl_args, wait_for_previous
from ft.utils import div_even


@triton.jit
def gates(b, a, A_log, dt_bias):
    """beta = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias), all fp32. softplus is torch's:
    x above 20, else log1p(e^x), with log1p(e) = log(u) · e / (u − 1), u = 1 + e rounded (Goldberg),
    accurate where e is far below 1 and log(1 + e) would lose its digits."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    return -tl.exp(A_log.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))


@triton.jit
def qk_normed(q, k, scale):
    """q / sqrt(|q|² + 1e-6) · scale and k / sqrt(|k|² + 1e-6), fp32."""
    return q * (tl.rsqrt(tl.sum(q * q) + 1e-6) * scale), k * tl.rsqrt(tl.sum(k * k) + 1e-6)


@triton.jit
def delta_step(s, q, k, v, g, beta):
    """The state tile s [BK, BV] after one token (q, k [BK] normed, v [BV]), and its output o [BV]."""
    s = s * tl.exp(g)
    u = beta * (v - tl.sum(s * k[:, None], 0))  # [BV]
    s += k[:, None] * u[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _token(mixed, b, a, o, s, t, i_h, i_hk, g_scale, dt_h, kk, vv, mk, mv, s_mt, s_bt, s_bh, s_at, s_ah,
           s_ot, s_oh, scale, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):  # fmt: skip
    """One token of one sequence: the state tile s [BK, BV] after it; its output row stored."""
    row = mixed + t * s_mt  # [q (Hk·dk) | k (Hk·dk) | v (Hv·dv)]
    q = tl.load(row + i_hk * DK + kk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(row + (HK + i_hk) * DK + kk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + i_h * DV + vv, mask=mv, other=0.0).to(tl.float32)
    q, k = qk_normed(q, k, scale)
    g, beta = gates(tl.load(b + t * s_bt + i_h * s_bh), tl.load(a + t * s_at + i_h * s_ah), g_scale, dt_h)
    s, out = delta_step(s, q, k, v, g, beta)
    tl.store(o + t * s_ot + i_h * s_oh + vv, out.to(o.dtype.element_ty), mask=mv)
    return s


@triton.jit
def _recurrent_kernel(
    mixed,
    b,
    a,
    A_log,
    dt_bias,
    state,
    cu_seqlens,
    context_lens,
    state_slots,
    o,
    s_mt,
    s_bt,
    s_bh,
    s_at,
    s_ah,
    s_ss,
    s_sh,
    s_sk,
    s_ot,
    s_oh,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    if VARLEN:  # sequence i_b owns rows cu_seqlens[i_b] .. cu_seqlens[i_b + 1]
        bos = tl.load(cu_seqlens + i_b).to(tl.int64)
        eos = tl.load(cu_seqlens + i_b + 1).to(tl.int64)
    else:  # decode: row i_b, told from shapes alone
        bos = i_b
        eos = i_b + 1
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    mk, mv = kk < DK, vv < DV
    slot = tl.load(state_slots + i_b).to(tl.int64)
    if slot < 0:
        for t in range(bos, eos):
            tl.store(
                o + t * s_ot + i_h * s_oh + vv, tl.zeros([BV], tl.float32).to(o.dtype.element_ty), mask=mv
            )
        return
    has_ctx = tl.load(context_lens + i_b) > 0
    i_hk = i_h // (HV // HK)
    g_scale, dt_h = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    p_s = state + slot * s_ss + i_h * s_sh + kk[:, None] * s_sk + vv[None, :]
    live = mk[:, None] & mv[None, :]
    s = tl.load(p_s, mask=live & has_ctx, other=0.0)  # [BK, BV]
    if VARLEN:
        for t in range(bos, eos):
            s = _token(mixed, b, a, o, s, t, i_h, i_hk, g_scale, dt_h, kk, vv, mk, mv, s_mt, s_bt, s_bh,
                       s_at, s_ah, s_ot, s_oh, scale, HK, DK, DV)  # fmt: skip
    else:
        s = _token(mixed, b, a, o, s, bos, i_h, i_hk, g_scale, dt_h, kk, vv, mk, mv, s_mt, s_bt, s_bh,
                   s_at, s_ah, s_ot, s_oh, scale, HK, DK, DV)  # fmt: skip
    tl.store(p_s, s, mask=live)


def gdn_recurrent(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """mixed [T, 2·Hk·dk + Hv·dv] (the conv output, heads in order), b and a [T, Hv] (any strides),
    A_log and dt_bias [Hv], ssm_state [slots, Hv, dk, dv] fp32 updated in place
    -> o [T, Hv, dv] in mixed's dtype. Head counts and sizes are read from the shapes. A decode
    batch (T = B) runs a token per program; otherwise each program walks its sequence's rows
    (``batch.cu_seqlens``) in order, which suits short sequences only."""
    n, width = mixed.shape
    bsz = batch.state_slots.shape[0]
    hv, dk, dv = ssm_state.shape[1:]
    hk = div_even(width - hv * dv, 2 * dk, f"conv width {width} minus Hv·dv={hv * dv}, as q and k heads")
    assert hk > 0 and hv % hk == 0, f"value heads {hv} must be a multiple of key heads {hk}"
    assert max(dk, dv) <= 256, f"head dims dk={dk}, dv={dv} above 256 would spill the state tile"
    assert b.shape == a.shape == (n, hv), f"b {tuple(b.shape)}, a {tuple(a.shape)} must be [{n}, {hv}]"
    assert A_log.shape == dt_bias.shape == (hv,), f"A_log {A_log.shape}, dt_bias {dt_bias.shape} != [{hv}]"
    assert A_log.stride(0) == 1 and dt_bias.stride(0) == 1, "A_log and dt_bias must be contiguous"
    assert batch.context_lens.shape == (bsz,) and batch.cu_seqlens.shape == (bsz + 1,), (
        f"{bsz} state slots but {batch.context_lens.shape[0]} context lengths, "
        f"{batch.cu_seqlens.shape[0]} sequence bounds"
    )
    assert mixed.stride(-1) == 1, "the conv output must be contiguous in its channels"
    assert ssm_state.dtype == torch.float32 and ssm_state.stride(-1) == 1, (
        f"ssm_state must be fp32 with contiguous rows, got {ssm_state.dtype} strides {ssm_state.stride()}"
    )
    o = torch.empty(n, hv, dv, dtype=mixed.dtype, device=mixed.device)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 4096 // bk))  # [BK, BV] fp32 = 16 KiB, 32 regs/thread
    _recurrent_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        mixed,
        b,
        a,
        A_log,
        dt_bias,
        ssm_state,
        batch.cu_seqlens,
        batch.context_lens,
        batch.state_slots,
        o,
        mixed.stride(0),
        *b.stride(),
        *a.stride(),
        *ssm_state.stride()[:3],
        *o.stride()[:2],
        dk**-0.5,
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        VARLEN=n != bsz,
        num_warps=4,
        **pdl_args(mixed),
    )
    return o


@triton.jit
def _gates_kernel(
    b, a, A_log, dt_bias, g, beta, T, HV, s_bt, s_bh, s_at, s_ah, BT: tl.constexpr, BH: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # t · s_bt: int32 only to 173k tokens
    h = tl.arange(0, BH)
    live = (t < T)[:, None] & (h < HV)[None, :]
    g_t, beta_t = gates(
        tl.load(b + t[:, None] * s_bt + h[None, :] * s_bh, mask=live, other=0.0),
        tl.load(a + t[:, None] * s_at + h[None, :] * s_ah, mask=live, other=0.0),
        tl.load(A_log + h, mask=h < HV, other=0.0)[None, :],
        tl.load(dt_bias + h, mask=h < HV, other=0.0)[None, :],
    )
    out = t[:, None] * HV + h[None, :]
    tl.store(g + out, g_t, mask=live)
    tl.store(beta + out, beta_t, mask=live)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, Hv] (any strides), A_log, dt_bias [Hv] -> (g, beta) [T, Hv] fp32, contiguous."""
    t, hv = b.shape
    assert a.shape == b.shape, f"a {tuple(a.shape)} and b {tuple(b.shape)} differ"
    assert A_log.shape == dt_bias.shape == (hv,), f"A_log {A_log.shape}, dt_bias {dt_bias.shape} != [{hv}]"
    assert A_log.stride(0) == 1 and dt_bias.stride(0) == 1, "A_log and dt_bias must be contiguous"
    g = torch.empty(t, hv, dtype=torch.float32, device=b.device)
    beta = torch.empty_like(g)
    if t > 0:
        bt = 32
        grid = (triton.cdiv(t, bt),)
        _gates_kernel[grid](
            b, a, A_log, dt_bias, g, beta, t, hv, *b.stride(), *a.stride(),
            BT=bt, BH=triton.next_power_of_2(hv), num_warps=4,
        )  # fmt: skip
    return g, beta
