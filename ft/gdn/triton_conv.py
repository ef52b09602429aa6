"""Causal depthwise conv1d + SiLU over a varlen batch, with per-sequence history in a slot pool.

Two launches: the first computes ``silu(conv(x))`` reading the last Kc-1 inputs of each sequence
from ``conv_state[slot]`` (zeros when the sequence has no context); the second, ordered after it
on the stream, overwrites ``conv_state[slot]`` with the new last Kc-1 inputs. Splitting them keeps
the in-place update race-free without a per-sequence serial loop. A decode batch (one token per
sequence) can take one launch instead (``DECODE_ONE_LAUNCH``): a program owns its (sequence,
channel block) alone, loads the history, waits at a barrier for its threads' loads, then shifts
the history in place. Same contract as ``TorchGDN.conv``; it is not a general conv (no bias, no
strides, no dilation).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.forward_context import ForwardBatch
from ft.layers.pdl import pdl_args, wait_for_previous

# (tokens, channels) per program of the output kernel, for decode and for longer chunks; module
# constants so that tests/gpu/config_sweep.py can try others
DECODE_TILE = (2, 256)
PREFILL_TILE = (32, 128)
NUM_WARPS = 4
# Decode in one launch (``_conv_decode_kernel``) instead of two: 18 launches fewer per step of the
# 24-layer Qwen3-Next. On since 2026-12-01 (H200: batch-1 456 -> 476 tok/s, same tokens;
# FT_CONV_DECODE_ONE_LAUNCH=0 turns it off).
DECODE_ONE_LAUNCH = os.environ.get("FT_CONV_DECODE_ONE_LAUNCH", "1") != "0"


@triton.jit
def _conv_out_kernel(
    x,
    w,
    conv_state,
    cu_seqlens,
    context_lens,
    state_slots,
    out,
    C,
    s_xt,
    s_ot,
    s_wc,
    s_ss,
    s_sc,
    KC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    tb = tl.program_id(0)
    b = tl.program_id(1)
    cb = tl.program_id(2)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    qlen = tl.load(cu_seqlens + b + 1).to(tl.int64) - bos
    if tb * BLOCK_T >= qlen:
        return
    # a scalar flag: masks take it through tl.where (triton 3.9's interpreter makes a scalar bool
    # and a bool block an int32 mask, which its loads refuse)
    has_hist = tl.load(context_lens + b) > 0
    slot = tl.load(state_slots + b).to(tl.int64)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    live = (t < qlen)[:, None] & (c < C)[None, :]  # [BT, BC]
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(KC):
        p = t - (KC - 1) + j  # input position relative to the chunk; < 0 reads the history
        wj = tl.load(w + c * s_wc + j, mask=c < C, other=0.0).to(tl.float32)
        xin = tl.load(x + (bos + p)[:, None] * s_xt + c[None, :], mask=live & (p >= 0)[:, None], other=0.0)
        hmask = tl.where(has_hist, live & (p < 0)[:, None], False)
        hin = tl.load(
            conv_state + slot * s_ss + c[None, :] * s_sc + (KC - 1 + p)[:, None], mask=hmask, other=0.0
        )
        acc += (xin.to(tl.float32) + hin.to(x.dtype.element_ty).to(tl.float32)) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out + (bos + t)[:, None] * s_ot + c[None, :], y.to(out.dtype.element_ty), mask=live)


@triton.jit
def _conv_state_kernel(
    x,
    conv_state,
    cu_seqlens,
    context_lens,
    state_slots,
    C,
    s_xt,
    s_ss,
    s_sc,
    KC: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    cb = tl.program_id(1)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    qlen = tl.load(cu_seqlens + b + 1).to(tl.int64) - bos
    has_hist = tl.load(context_lens + b) > 0
    slot = tl.load(state_slots + b).to(tl.int64)
    m = tl.arange(0, KP)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    live = (c < C)[:, None] & (m < KC - 1)[None, :]  # [BC, KP]
    idx = qlen + m  # position in [history (Kc-1) | chunk (qlen)] of the new state's column m
    from_x = (idx >= KC - 1)[None, :]
    xin = tl.load(x + (bos + idx - (KC - 1))[None, :] * s_xt + c[:, None], mask=live & from_x, other=0.0)
    base = conv_state + slot * s_ss + c[:, None] * s_sc
    hin = tl.load(base + idx[None, :], mask=tl.where(has_hist, live & ~from_x, False), other=0.0)
    # each program owns its (slot, channel block): all loads above happen before this store
    tl.store(base + m[None, :], tl.where(from_x, xin.to(hin.dtype), hin), mask=live)


@triton.jit
def conv_decode_channels(x_row, w, base, c, cmask, has_hist, s_wc, KC: tl.constexpr, KP: tl.constexpr):
    # channels c of one token: (silu(sum_j w[c, j] · [history | x][c, j]) as fp32 [BC], the history
    # shifted by one [BC, KP]: its columns 1 .. Kc-2, then x), the history read at base + m (m < Kc-1;
    # zeros without ``has_hist``). The caller stores the shifted history (``store_history``) once
    # every thread of the program has read it: the same sums, in the same order and rounding, as
    # ``_conv_out_kernel`` then ``_conv_state_kernel``
    m = tl.arange(0, KP)
    live = cmask[:, None] & (m < KC - 1)[None, :]  # [BC, KP]
    hist = tl.load(base + m[None, :], mask=tl.where(has_hist, live, False), other=0.0)
    ahead_cols = live & (m < KC - 2)[None, :]
    ahead = tl.load(base + m[None, :] + 1, mask=tl.where(has_hist, ahead_cols, False), other=0.0)
    xin = tl.load(x_row + c, mask=cmask, other=0.0)  # [BC]
    acc = tl.zeros(c.shape, tl.float32)
    for j in tl.static_range(KC):
        wj = tl.load(w + c * s_wc + j, mask=cmask, other=0.0).to(tl.float32)
        if j == KC - 1:
            v = xin.to(tl.float32)
        else:  # column j of the history (a sum of one value and zeros: exact)
            v = tl.sum(tl.where(m[None, :] == j, hist.to(x_row.dtype.element_ty).to(tl.float32), 0.0), 1)
        acc += v * wj
    return acc * tl.sigmoid(acc), tl.where((m == KC - 2)[None, :], xin[:, None].to(hist.dtype), ahead)


@triton.jit
def store_history(base, shifted, cmask, KC: tl.constexpr, KP: tl.constexpr):
    m = tl.arange(0, KP)
    tl.store(base + m[None, :], shifted, mask=cmask[:, None] & (m < KC - 1)[None, :])


@triton.jit
def _conv_decode_kernel(
    x,
    w,
    conv_state,
    context_lens,
    state_slots,
    out,
    C,
    s_xt,
    s_ot,
    s_wc,
    s_ss,
    s_sc,
    KC: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # one token of sequence b (``conv_decode_channels``), its history shifted in place
    wait_for_previous(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    has_hist = tl.load(context_lens + b) > 0
    slot = tl.load(state_slots + b).to(tl.int64)
    base = conv_state + slot * s_ss + c[:, None] * s_sc
    y, shifted = conv_decode_channels(x + b * s_xt, w, base, c, cmask, has_hist, s_wc, KC, KP)
    tl.store(out + b * s_ot + c, y.to(out.dtype.element_ty), mask=cmask)
    tl.debug_barrier()  # every thread's history loads are done before any column is overwritten
    store_history(base, shifted, cmask, KC, KP)


def causal_conv1d_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    batch: ForwardBatch,
    max_query_len: int,
) -> torch.Tensor:
    """x [T, C], weight [C, Kc], conv_state [slots, C, Kc-1] (updated in place) -> [T, C]."""
    t, c = x.shape
    kc = weight.shape[-1]
    assert x.is_cuda and weight.shape == (c, kc), f"weight {tuple(weight.shape)} does not fit x [T, {c}]"
    assert conv_state.shape[1:] == (c, kc - 1), f"conv_state {conv_state.shape} is not [S, {c}, {kc - 1}]"
    assert conv_state.stride(-1) == 1, "conv_state must be contiguous in its last dimension"
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    bsz = batch.cu_seqlens.shape[0] - 1
    if DECODE_ONE_LAUNCH and max_query_len == 1 and t == bsz:
        _conv_decode_kernel[(bsz, triton.cdiv(c, DECODE_TILE[1]))](
            x, weight, conv_state, batch.context_lens, batch.state_slots, out, c, x.stride(0),
            out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), KC=kc,
            KP=triton.next_power_of_2(kc), BLOCK_C=DECODE_TILE[1], num_warps=NUM_WARPS, **pdl_args(x),
        )  # fmt: skip
        return out
    args = (batch.cu_seqlens, batch.context_lens, batch.state_slots)
    block_t, block_c = DECODE_TILE if max_query_len == 1 else PREFILL_TILE
    grid = (triton.cdiv(max_query_len, block_t), bsz, triton.cdiv(c, block_c))
    _conv_out_kernel[grid](
        x,
        weight,
        conv_state,
        *args,
        out,
        c,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        KC=kc,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=NUM_WARPS,
        **pdl_args(x),
    )
    _conv_state_kernel[(bsz, triton.cdiv(c, 128))](
        x,
        conv_state,
        *args,
        c,
        x.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        KC=kc,
        KP=triton.next_power_of_2(max(kc - 1, 1)),
        BLOCK_C=128,
        num_warps=4,
        **pdl_args(x),
    )
    return out
