"""The GEMV's device pieces, as ``triton_gemv``'s kernels, the fused router and the conv-in-proj
kernel call them: a program's tile of x @ W.T over a range of K (``gemv_tile``), the same with a
pre-norm folded in (``normed_gemv_tile``), and a split over K summed by ticket (``split_k_sum``,
``normed_split_k_sum``). The maths, the tiles and why: ``triton_gemv``. Not here: launches.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# the interpreter runs no PTX: ``_pinned`` is the identity there
PIN_ASM: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _step(ptr, rows, kk, left, EVEN_K: tl.constexpr):
    # one BLOCK_K step of rows ``rows`` [R] (a mask) at ``ptr`` [R, BK], the inputs past ``left`` zero
    if EVEN_K:
        return tl.load(ptr, mask=rows[:, None], other=0.0)
    return tl.load(ptr, mask=rows[:, None] & (kk < left)[None, :], other=0.0)


@triton.jit
def gemv_tile(
    x, w, n, M, N, k_lo, k_hi, s_xm, s_wn,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    # x[:, k_lo:k_hi] @ w[n, k_lo:k_hi].T as fp32 [M_P, BN]; EVEN_K: every step is whole
    m = tl.arange(0, M_P)
    kk = tl.arange(0, BLOCK_K)
    nmask, mmask = n < N, m < M
    x_ptr = x + m[:, None].to(tl.int64) * s_xm + (k_lo + kk)[None, :]  # [M_P, BK]
    w_ptr = w + n[:, None].to(tl.int64) * s_wn + (k_lo + kk)[None, :]  # [BN, BK]
    acc = tl.zeros([M_P, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        xt = _step(x_ptr, mmask, kk, k_hi - k0, EVEN_K)
        wt = _step(w_ptr, nmask, kk, k_hi - k0, EVEN_K)
        acc += tl.dot(xt, tl.trans(wt))  # [M_P, BN], fp32
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    return acc


@triton.jit
def _pinned(v, ASM: tl.constexpr):
    # v itself (16-bit values), through an instruction the compiler may not repeat: computed once in
    # their own layout and moved to the MMA operand's through shared memory, not recomputed in it.
    # The interpreter runs no PTX (ASM off): there it is v.
    if ASM:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=2)
    return v


def norm_rows(m: int) -> int:
    """The rows ``normed_gemv_tile`` computes the norm on for M rows: M's power of two, at least 2
    (compiled for sm_90 a single row's layout is the MMA operand's own, replicated 32 times)."""
    return max(2, triton.next_power_of_2(m))


@triton.jit
def rows_repeated(v, M_P: tl.constexpr):
    # v [T_P, C] -> [M_P, C] whose row i is v's row i % T_P (T_P divides M_P)
    T_P: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    return tl.reshape(tl.broadcast_to(v[None, :, :], [M_P // T_P, T_P, C]), [M_P, C])


@triton.jit
def normed_gemv_tile(
    x, r, nw, h, w, n, M, N, k_lo, k_hi, s_xm, s_rm, s_hm, s_wn, store_h,
    M_P: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):  # fmt: skip
    # ``gemv_tile`` of the norm's input before its 1 / rms (``norm.FOLD_INPUT_NORM``), as triton_norm
    # rounds: h = x + r rounded (stored to ``h`` where store_h), h · w' rounded to x's dtype (w' the
    # norm's weight, plus 1 when zero-centred) the MMA's operand. Computed on T_P rows (``norm_rows``)
    # once (``_pinned``) and repeated to the MMA's M_P: compiled for sm_90 at WIDE's tiles a K step
    # is 288 instructions and 110 registers at one token (T_P 2), 345 and 144 at four; the same
    # arithmetic written on all 16 rows was 1,057 and 204, on one row without the pin 632 and 182
    # (the plain GEMV: 181 and 72). Returns (the products fp32 [M_P, BN], each row's sum of h² over
    # k_lo .. k_hi fp32 [M_P, 1]), rows repeated as the MMA's.
    t = tl.arange(0, T_P)
    kk = tl.arange(0, BLOCK_K)
    nmask, tmask = n < N, t < M
    x_ptr = x + t[:, None].to(tl.int64) * s_xm + (k_lo + kk)[None, :]  # [T_P, BK]
    r_ptr = r + t[:, None].to(tl.int64) * s_rm + (k_lo + kk)[None, :]
    h_ptr = h + t[:, None].to(tl.int64) * s_hm + (k_lo + kk)[None, :]
    w_ptr = w + n[:, None].to(tl.int64) * s_wn + (k_lo + kk)[None, :]  # [BN, BK]
    acc = tl.zeros([M_P, BLOCK_N], tl.float32)
    squares = tl.zeros([T_P], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        xt = _step(x_ptr, tmask, kk, k_hi - k0, EVEN_K)
        wt = _step(w_ptr, nmask, kk, k_hi - k0, EVEN_K)
        ht = (xt.to(tl.float32) + _step(r_ptr, tmask, kk, k_hi - k0, EVEN_K).to(tl.float32)).to(xt.dtype)
        tl.store(h_ptr, ht, mask=tmask[:, None] & (kk < k_hi - k0)[None, :] & store_h)
        hf = ht.to(tl.float32)
        squares += tl.sum(hf * hf, 1)
        wn = tl.load(nw + k0 + kk, mask=kk < k_hi - k0, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            wn = wn + 1.0
        u = rows_repeated(_pinned((hf * wn[None, :]).to(xt.dtype), PIN_ASM), M_P)  # [M_P, BK]
        acc += tl.dot(u, tl.trans(wt))  # [M_P, BN], fp32
        x_ptr += BLOCK_K
        r_ptr += BLOCK_K
        h_ptr += BLOCK_K
        w_ptr += BLOCK_K
    return acc, rows_repeated(squares[:, None], M_P)


@triton.jit
def split_k_sum(
    x, w, ws, counters, n, M, N, K, K_SPLIT, s_xm, s_wn,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    # This program's partial over K_SPLIT inputs into ws[split]; returns (last, total): whether it
    # drew its column block's last ticket, and then the partials summed in split order.
    last, total, _ = normed_split_k_sum(x, x, x, x, w, ws, ws, counters, n, M, N, K, K_SPLIT, s_xm,
                                        s_xm, s_xm, s_wn, M_P, M_P, BLOCK_N, BLOCK_K, SPLITS, EVEN_K, False,
                                        False)  # fmt: skip
    return last, total


@triton.jit
def normed_split_k_sum(
    x, r, nw, h, w, ws, squares_ws, counters, n, M, N, K, K_SPLIT, s_xm, s_rm, s_hm, s_wn,
    M_P: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):  # fmt: skip
    # ``split_k_sum``, and with NORM over ``normed_gemv_tile``: the first column block's programs
    # store h for their splits, each program its rows' sums of h² into squares_ws [blocks, SPLITS,
    # M_P], and the last of a column block returns them summed in split order: (last, total, squares
    # [M_P, 1]).
    split = tl.program_id(1)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    m = tl.arange(0, M_P)
    mine = squares_ws + tl.program_id(0) * SPLITS * M_P + m[:, None]  # this column block's [SPLITS, M_P]
    if NORM:
        acc, squares = normed_gemv_tile(x, r, nw, h, w, n, M, N, k_lo, k_hi, s_xm, s_rm, s_hm, s_wn,
                                        tl.program_id(0) == 0, M_P, T_P, BLOCK_N, BLOCK_K, EVEN_K,
                                        ZERO_CENTERED)  # fmt: skip
        tl.store(mine + split * M_P, squares)
    else:
        acc = gemv_tile(x, w, n, M, N, k_lo, k_hi, s_xm, s_wn, M_P, BLOCK_N, BLOCK_K, EVEN_K)
    mask = (m < M)[:, None] & (n < N)[None, :]
    part = ws + m[:, None] * N + n[None, :]  # [M_P, BN] in one split's [M, N]
    tl.store(part + split * M * N, acc, mask=mask)
    # the ticket is one thread's atomic: the barrier puts every thread's stores before its release
    tl.debug_barrier()
    ticket = tl.atomic_add(counters + tl.program_id(0), 1, sem="acq_rel")
    last = ticket == SPLITS - 1
    total = tl.zeros([M_P, BLOCK_N], tl.float32)
    squares = tl.zeros([M_P, 1], tl.float32)
    if last:  # the others' partials: past the acquire, read from L2 (.cg), not a stale L1 line
        for s in tl.static_range(SPLITS):
            total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if NORM:
                squares += tl.load(mine + s * M_P, cache_modifier=".cg")
        tl.store(counters + tl.program_id(0), 0)  # every ticket is drawn: clean for the next call
    return last, total, squares
