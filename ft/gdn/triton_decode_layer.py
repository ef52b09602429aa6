"""A Gated DeltaNet decode step in one launch: causal conv1d, gates, delta rule and the gated norm.

For B sequences of one token each, what ``causal_conv1d_silu`` (decode), ``gdn_recurrent`` and
``gated_rms_norm`` compute in three launches:

    q, k, v = silu(conv([history | x]))   per channel; the history shifted by one, in place
    S = exp(g) · S;  u = beta · (v − Sᵀk);  S = S + k uᵀ;  o = Sᵀq     (``triton_decode``)
    y = (o / rms(o)) · w · silu(z)        per value head, over dv

A program owns one (sequence, value head, ``BV`` state columns), as the recurrent kernel's do:
its v channels' conv and their history, and its columns of the state. Two things span programs
and take a ticket (``triton_gemv.tickets``: an atomic counter, the last to draw it acts and
resets it): every program of a key head computes its q and k from the conv history that the
last of them then shifts, once all have read it; and each program stores its rounded part of o
in y, where the last of the head's programs reads the whole head back and writes y over it.
Every value is rounded where the three kernels round it (the conv output and o to the
activations' dtype before they are read again); only the fp32 order of the norm's sum of
squares may differ. The output y [B, Hv·dv] is what the output projection reads.

Why it was tried: the census of a Qwen3-Next decode step (docs/benchmarks.md) has three kernels
of ~2-4 us each in every one of its 36 GDN layers, each moving a few KB; one launch measured no
faster (``FUSED_DECODE``, off). Given the conv's output (``convolved``: the conv ran in in_proj's
epilogue) the launch starts after the conv. Not here: sequences of several tokens (prefill,
snapshot tails), dk or dv above 256.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.forward_context import ForwardBatch
from ft.gdn.triton_conv import conv_decode_channels, store_history
from ft.gdn.triton_decode import delta_step, gates, qk_normed
from ft.layers import triton_gemv
from ft.layers.pdl import pdl_args, wait_for_previous
from ft.layers.triton_norm import gated_norm_rows
from ft.utils import div_even

# OFF: timed even on an H200 (docs/benchmarks.md, 2026-12-03; FT_GDN_FUSED_DECODE=1 turns it on for a
# process and the ranks it spawns). The 80B with NVFP4 experts, batch-1 decode in one process:
# defaults 303.5 tok/s, this 304.5, the defaults again 308.8 (rows of one setting spread by ~2%);
# its GPU tests pass. Our reading, not profiled: with PDL the two launches it saves already
# overlapped their neighbours, and what remains is the chain of dependent loads and reductions that
# one program now walks (conv, q/k norms, state update, ticket, norm). A first version, a program
# per (sequence, key head) holding its value heads' whole states, took ~18 us a layer against the
# three kernels' ~8.6 (311.3 -> 280.6 tok/s): 16 programs at batch 1, 256 KB each through one SM.
# Since the conv runs in in_proj's epilogue (``triton_conv_proj.CONV_IN_PROJ``, on from 2026-12-05)
# the step starts after it (``CONV=False``: q, k, v read from the projection's output, no history
# and no q/k ticket): the recurrence and the gated norm in one launch instead of two, the same
# bits but the norm's sum order; compiled for sm_90 at 94 registers, not yet timed.
FUSED_DECODE = os.environ.get("FT_GDN_FUSED_DECODE", "0") == "1"
BV = 32  # state columns a program owns, as the recurrent kernel's: [dk, 32] fp32, dv / BV programs a head
NUM_WARPS = 4
MAX_HEAD_DIM = 256  # as the recurrent kernel: a program's [dk, BV] state tile and a head's output


@triton.jit
def _decode_layer_kernel(
    qkv, z, b, a, conv_w, conv_state, A_log, dt_bias, ssm_state, norm_w, context_lens, state_slots, y,
    counters, s_xt, s_zt, s_zh, s_bt, s_bh, s_at, s_ah, s_wc, s_cs, s_cc, s_ss, s_sh, s_sk, s_yt, scale, eps,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr,
    KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DV_P: tl.constexpr, ROUND_MID: tl.constexpr,
    USE_PDL: tl.constexpr = False, CONV: tl.constexpr = True,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    # program (sequence i_b, value head i_h, columns i_v · BV ..): its v channels' conv and history, its
    # state columns; every program of a key head computes that head's q and k, the last of them (a
    # ticket) shifts their history; the last of a value head's programs (another) normalises its output
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    R: tl.constexpr = HV // HK  # value heads per key head
    NV: tl.constexpr = (DV + BV - 1) // BV  # programs per value head
    dt = y.dtype.element_ty
    i_hk = i_h // R
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    mk, mv = kk < DK, vv < DV
    slot = tl.load(state_slots + i_b).to(tl.int64)
    y_head = y + i_b * s_yt + i_h * DV  # its output row, o rounded until the last program normalises it
    if slot < 0:  # a padding row: no state touched, o = 0 and so y = 0
        tl.store(y_head + vv, tl.zeros([BV], tl.float32).to(dt), mask=mv)
        return
    has_ctx = tl.load(context_lens + i_b) > 0
    x_row = qkv + i_b * s_xt  # [q (Hk·dk) | k (Hk·dk) | v (Hv·dv)]
    cq, ck, cv = i_hk * DK + kk, (HK + i_hk) * DK + kk, 2 * HK * DK + i_h * DV + vv
    if CONV:
        hist = conv_state + slot * s_cs
        q_base, k_base, v_base = (
            hist + cq[:, None] * s_cc,
            hist + ck[:, None] * s_cc,
            hist + cv[:, None] * s_cc,
        )
        q, q_hist = conv_decode_channels(x_row, conv_w, q_base, cq, mk, has_ctx, s_wc, KC, KP)
        k, k_hist = conv_decode_channels(x_row, conv_w, k_base, ck, mk, has_ctx, s_wc, KC, KP)
        v, v_hist = conv_decode_channels(x_row, conv_w, v_base, cv, mv, has_ctx, s_wc, KC, KP)
        # every thread's history loads are done before any column is overwritten, here or (after the
        # ticket's release) by the program that shifts q's and k's
        tl.debug_barrier()
        store_history(v_base, v_hist, mv, KC, KP)
        qk_counter = counters + i_b * HK + i_hk
        if tl.atomic_add(qk_counter, 1, sem="acq_rel") == R * NV - 1:  # every reader of q's and k's is done
            store_history(q_base, q_hist, mk, KC, KP)
            store_history(k_base, k_hist, mk, KC, KP)
            tl.store(qk_counter, 0)  # clean for the next call
    else:  # qkv is the conv's output already (in_proj's epilogue, ``triton_conv_proj``)
        q = tl.load(x_row + cq, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(x_row + ck, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(x_row + cv, mask=mv, other=0.0).to(tl.float32)
    # as the conv kernel stores them and the recurrent kernel reads them back
    q, k = qk_normed(q.to(dt).to(tl.float32), k.to(dt).to(tl.float32), scale)
    g, beta = gates(
        tl.load(b + i_b * s_bt + i_h * s_bh), tl.load(a + i_b * s_at + i_h * s_ah),
        tl.load(A_log + i_h), tl.load(dt_bias + i_h),
    )  # fmt: skip
    live = mk[:, None] & mv[None, :]
    p_s = ssm_state + slot * s_ss + i_h * s_sh + kk[:, None] * s_sk + vv[None, :]
    s = tl.load(p_s, mask=tl.where(has_ctx, live, False), other=0.0)  # [BK, BV]
    s, o = delta_step(s, q, k, v.to(dt).to(tl.float32), g, beta)
    tl.store(p_s, s, mask=live)
    dd = tl.arange(0, DV_P)
    if NV == 1:  # the program holds the head's whole output
        o_head = tl.reshape(o.to(dt).to(tl.float32), [1, DV_P])
    else:  # the head's last program normalises the rounded outputs its others stored
        tl.store(y_head + vv, o.to(dt), mask=mv)
        tl.debug_barrier()  # every thread's stores before the ticket's release
        o_counter = counters + tl.num_programs(0) * HK + i_b * HV + i_h
        if tl.atomic_add(o_counter, 1, sem="acq_rel") != NV - 1:
            return
        tl.store(o_counter, 0)
        o_head = tl.load(y_head + dd[None, :], mask=(dd < DV)[None, :], other=0.0, cache_modifier=".cg")
        o_head = o_head.to(tl.float32)
    zf = tl.load(z + i_b * s_zt + i_h * s_zh + dd[None, :], mask=(dd < DV)[None, :], other=0.0).to(tl.float32)
    out = gated_norm_rows(o_head, zf, norm_w, dd, DV, eps, dt, ROUND_MID)
    tl.store(y_head + dd[None, :], out.to(dt), mask=(dd < DV)[None, :])


def fits(ssm_state: torch.Tensor) -> bool:
    """Whether a layer with this state pool [slots, Hv, dk, dv] can take the fused step."""
    return max(ssm_state.shape[2:]) <= MAX_HEAD_DIM


def gdn_decode_layer(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    batch: ForwardBatch,
    convolved: bool = False,
) -> torch.Tensor:
    """One decode token per sequence: qkv [B, 2·Hk·dk + Hv·dv] (the conv input), z [B, Hv, dv], b and a
    [B, Hv] (any strides but the last), conv_weight [C, Kc], conv_state [slots, C, Kc-1] and
    ssm_state [slots, Hv, dk, dv] fp32 (both updated in place), norm_weight [dv]
    -> y [B, Hv·dv] in qkv's dtype, the gated norm of the delta rule's output. ``convolved``: qkv is
    the conv's output already (``triton_conv_proj.CONV_IN_PROJ``); the conv operands are not read."""
    n, width = qkv.shape
    hv, dk, dv = ssm_state.shape[1:]
    hk = div_even(width - hv * dv, 2 * dk, f"conv width {width} minus Hv·dv={hv * dv}, as q and k heads")
    assert hk > 0 and hv % hk == 0, f"value heads {hv} must be a multiple of key heads {hk}"
    assert fits(ssm_state), f"head dims dk={dk}, dv={dv}: {MAX_HEAD_DIM} at most"
    assert batch.state_slots.shape == (n,) and batch.context_lens.shape == (n,), (
        f"{n} tokens but {batch.state_slots.shape[0]} state slots: one decode token per sequence"
    )
    if convolved:  # stand-ins for the pointers and strides the kernel does not read
        conv_weight, conv_state = qkv[:, :1], qkv[:, None, :1]
    kc = conv_weight.shape[-1]
    assert convolved or (conv_weight.shape == (width, kc) and conv_weight.stride(-1) == 1), (
        f"conv weight {tuple(conv_weight.shape)} strides {conv_weight.stride()}: not [{width}, Kc] by rows"
    )
    assert convolved or (conv_state.shape[1:] == (width, kc - 1) and conv_state.stride(-1) == 1), (
        f"conv_state {tuple(conv_state.shape)} is not [S, {width}, {kc - 1}] with contiguous history"
    )
    assert z.shape == (n, hv, dv) and b.shape == a.shape == (n, hv), (
        f"z {tuple(z.shape)}, b {tuple(b.shape)}, a {tuple(a.shape)}: need [{n}, {hv}, {dv}] and [{n}, {hv}]"
    )
    assert qkv.stride(-1) == 1 and z.stride(-1) == 1, "qkv and z must be contiguous in their last dimension"
    assert A_log.shape == dt_bias.shape == (hv,) and A_log.stride(0) == 1 and dt_bias.stride(0) == 1, (
        f"A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} must be contiguous [{hv}]"
    )
    assert norm_weight.shape == (dv,), f"norm weight {tuple(norm_weight.shape)} is not [{dv}]"
    assert ssm_state.dtype == torch.float32 and ssm_state.stride(-1) == 1, (
        f"ssm_state must be fp32 with contiguous rows, got {ssm_state.dtype} strides {ssm_state.stride()}"
    )
    y = torch.empty(n, hv * dv, dtype=qkv.dtype, device=qkv.device)
    round_mid = torch.promote_types(qkv.dtype, norm_weight.dtype) == qkv.dtype
    bv = min(BV, triton.next_power_of_2(dv))
    assert n * (hk + hv) <= triton_gemv.COUNTERS, (
        f"{n} sequences x {hk + hv} heads: more tickets than counters"
    )
    _decode_layer_kernel[(n, hv, triton.cdiv(dv, bv))](
        qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, ssm_state, norm_weight, batch.context_lens,
        batch.state_slots, y, triton_gemv.tickets(qkv.device), qkv.stride(0), *z.stride()[:2], *b.stride(),
        *a.stride(), conv_weight.stride(0), *conv_state.stride()[:2], *ssm_state.stride()[:3], y.stride(0),
        dk**-0.5, eps, HK=hk, HV=hv, DK=dk, DV=dv, KC=kc, KP=triton.next_power_of_2(kc),
        BK=triton.next_power_of_2(dk), BV=bv, DV_P=triton.next_power_of_2(dv), ROUND_MID=round_mid,
        CONV=not convolved, num_warps=NUM_WARPS, **pdl_args(qkv),
    )  # fmt: skip
    return y
