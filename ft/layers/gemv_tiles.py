"""The GEMV's device pieces, as ``triton_gemv``'s kernels, the fused router and the conv-in-proj
kernel call them: a program's tile of x @ W.T over a range of K (``gemv_tile``) and a split over K
summed by ticket (``split_k_sum``). The maths, the tiles and why: ``triton_gemv``. Not here:
launches.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _step(ptr, rows, kk, left, EVEN_K: tl.constexpr):
    # one BLOCK_K step of rows ``rows`` [R] (a mask) at ``ptr`` [R, BK], the inputs past ``left`` zero
    if EVEN_K:
        return tl.load(ptr, mask=rows[:, None], other=0.0)
    return tl.load(ptr, mask=rows[:, None] & (kk < left)[None, :], other=0.0)


@triton.jit
def split_range(K, K_SPLIT, split):
    # the inputs k_lo .. k_hi of split ``split`` in a launch split over K
    k_lo = split * K_SPLIT
    return k_lo, tl.minimum(K, k_lo + K_SPLIT)


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
def split_k_sum(
    x, w, ws, counters, n, M, N, K, K_SPLIT, s_xm, s_wn,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    # This program's partial of its column block (program id 0) over its split's (program id 1)
    # K_SPLIT inputs into ws[split]; returns (last, total): whether it drew its column block's last
    # ticket, and then the partials summed in split order.
    block, split = tl.program_id(0), tl.program_id(1)
    k_lo, k_hi = split_range(K, K_SPLIT, split)
    acc = gemv_tile(x, w, n, M, N, k_lo, k_hi, s_xm, s_wn, M_P, BLOCK_N, BLOCK_K, EVEN_K)
    m = tl.arange(0, M_P)
    mask = (m < M)[:, None] & (n < N)[None, :]
    part = ws + m[:, None] * N + n[None, :]  # [M_P, BN] in one split's [M, N]
    tl.store(part + split * M * N, acc, mask=mask)
    # the ticket is one thread's atomic: the barrier puts every thread's stores before its release
    tl.debug_barrier()
    ticket = tl.atomic_add(counters + block, 1, sem="acq_rel")
    last = ticket == SPLITS - 1
    total = tl.zeros([M_P, BLOCK_N], tl.float32)
    if last:  # the others' partials: past the acquire, read from L2 (.cg), not a stale L1 line
        for s in tl.static_range(SPLITS):
            total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(counters + block, 0)  # every ticket is drawn: clean for the next call
    return last, total
