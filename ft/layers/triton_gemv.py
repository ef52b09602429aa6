"""Dense linear layers at decode sizes (a few rows) as a Triton GEMV: out = x @ W.T, x [M, K] with
M <= 16, W [N, K] bf16/fp16, fp32 accumulation.

In the batch-1 decode census of Qwen3-Next (docs/benchmarks.md) cuBLAS's one-row products take
about 44 µs per layer for about 18 µs of weight bytes; its kernels there use tiles 64 outputs
wide (``nvjet ... 8x64``), so a 2048-wide projection gets 32 thread blocks on a 132-SM H200. Here
one program owns BLOCK_N output columns for every row of x and walks K in BLOCK_K steps, so
N = 2048 is 128 programs with their loads in flight (``config``: 32-column programs for wide
projections, 16 for narrow ones, as tests/gpu/config_sweep.py timed them on an H200). x is
padded to 16 rows inside the program (masked loads), so each step is one MMA; the padding costs
no bytes.

``GEMV_MAX_TOKENS`` (0: off) is where ``ft.layers.linear.dense`` sends a product here instead of
``F.linear``. H200, 2026-11-30 (config_sweep, per call of a graph of calls over distinct
weights, Qwen3-Next shapes, Triton vs cuBLAS): the six projections of a layer sum to 50.2 vs
58.4 us at M=1 and 53.2 vs 64.8 us at M=4; cuBLAS wins only the 513-row router at M=1 (3.5 vs
4.9 us) and qkv by 0.4 us. Not here: bias, fp32 weights, quantised weights, M > 16.

Split over K (``SPLIT_K``, off by default): out_proj's 128 programs reach 45% of HBM bandwidth
and the router's 33 about 10% (docs/benchmarks.md), too few programs to keep 132 SMs' loads in
flight. The split kernel's grid is (column blocks, splits); each program stores its fp32 partial
product into a workspace [splits, M, N] and draws a ticket from its column block's counter. The
program with the last ticket sums the partials in split order 0, 1, ... (the same bits whichever
program finished last), writes the output and sets the counter back to 0, so the counters are
zero between calls and across CUDA-graph replays. No program waits for another (no spinning).
Ordering: Triton runs a scalar atomic in one thread, so a CTA barrier puts every thread's partial
stores before that thread's acq_rel (GPU scope) ticket; the ticket reaches the other threads
through shared memory behind a barrier, and the last program reads the partials from L2 (.cg).
The counters are one buffer per device (``tickets``): split launches on a device must not overlap
(one stream; with PDL every kernel still waits for its predecessor's end first thing).

With a pre-norm folded in (``launch_normed_gemv``, ``ft.layers.norm.FOLD_INPUT_NORM``, off) the
GEMV reads x and the residual r instead of ``rms_norm(x + r)``: it forms h = x + r and h · w' (w'
the norm's weight) as the norm kernel rounds them, takes h · w' as the MMA's operand, sums h² beside
and multiplies each row's products by its 1 / rms at the end; program 0 stores h, the residual
stream. The fused router does the same over its splits (``normed_split_k_sum``).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous

# the interpreter runs no PTX: ``_pinned`` is the identity there
PIN_ASM: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

GEMV_MAX_TOKENS = 4  # M = 5 .. 16 not timed yet
MAX_M = 16  # rows of x one program pads to (one MMA tile)
# (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, NUM_STAGES), module constants so config_sweep can try others:
WIDE = (32, 256, 4, 3)  # in_proj 12352 x 2048 15.4 us, qkv 9216 x 2048 12.8 us at M=1
NARROW = (16, 512, 4, 4)  # out_proj 2048 x 4096 8.8 us, shared expert 1024 x 2048 5.1 us at M=1
WIDE_N = 4096  # output columns from which a projection takes WIDE
# the normed GEMV's (``launch_normed_gemv``): its input tile is computed (h = x + r, the norm's
# weight) and moved to the MMA operand through shared memory, so its tiles are its own. Compiled
# for sm_90 (Triton 3.6): WIDE's 110 registers at one token, 144 at four, no spill (the plain
# kernel 72); NARROW's (16, 512, 4, 4) 146 (it spilled before ``_pinned``), (16, 256, 4, 3) 96.
# NOT yet timed: config_sweep.py normed_gemv.
NORMED_WIDE = WIDE
NORMED_NARROW = (16, 256, 4, 3)

# OFF until timed on a GPU: the split kernel has run only under Triton's CPU interpreter, NOT yet
# on a GPU. FT_GEMV_SPLIT_K=1 turns it on for a process and the ranks it spawns.
SPLIT_K = os.environ.get("FT_GEMV_SPLIT_K", "0") != "0"
PROGRAMS_PER_SM = 2  # split until a projection has about this many programs per SM
MAX_SPLITS = 8
MIN_SPLIT_K = 256  # inputs one split reads at the least
COUNTERS = 1 << 16  # tickets per device: one per column block (and one per launch for the router)


def config(n: int) -> tuple[int, int, int, int]:
    return WIDE if n >= WIDE_N else NARROW


def normed_config(n: int) -> tuple[int, int, int, int]:
    """``config`` for a GEMV with a norm folded in (``NORMED_WIDE``, ``NORMED_NARROW``)."""
    return NORMED_WIDE if n >= WIDE_N else NORMED_NARROW


def takes(x, w: torch.Tensor) -> bool:
    """Whether x @ w.T (x a tensor, or a norm's input folded: ``ft.layers.norm.FoldedNorm``) is a
    product for the GEMV: at most ``GEMV_MAX_TOKENS`` rows of bf16/fp16 on a GPU, w of x's dtype."""
    return (
        x.is_cuda
        and len(x.shape) == 2
        and 0 < x.shape[0] <= GEMV_MAX_TOKENS
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
    )


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


@triton.jit
def _gemv_kernel(
    x, w, out, M, N, K, s_xm, s_wn, s_om,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_P)
    acc = gemv_tile(x, w, n, M, N, 0, K, s_xm, s_wn, M_P, BLOCK_N, BLOCK_K, EVEN_K)
    o_ptr = out + m[:, None].to(tl.int64) * s_om + n[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _normed_gemv_kernel(
    x, r, nw, h, w, out, M, N, K, eps, s_xm, s_rm, s_hm, s_wn, s_om,
    M_P: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_P)
    acc, squares = normed_gemv_tile(x, r, nw, h, w, n, M, N, 0, K, s_xm, s_rm, s_hm, s_wn,
                                    tl.program_id(0) == 0, M_P, T_P, BLOCK_N, BLOCK_K, EVEN_K,
                                    ZERO_CENTERED)  # fmt: skip
    acc = acc * tl.rsqrt(squares / K + eps)  # the norm's 1 / rms [M_P, 1], applied to the products
    o_ptr = out + m[:, None].to(tl.int64) * s_om + n[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _gemv_split_k_kernel(
    x, w, out, ws, counters, M, N, K, K_SPLIT, s_xm, s_wn, s_om,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    last, total = split_k_sum(x, w, ws, counters, n, M, N, K, K_SPLIT, s_xm, s_wn, M_P, BLOCK_N,
                              BLOCK_K, SPLITS, EVEN_K)  # fmt: skip
    if last:
        m = tl.arange(0, M_P)
        o_ptr = out + m[:, None].to(tl.int64) * s_om + n[None, :]
        tl.store(o_ptr, total.to(out.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def balanced_splits(n: int, k: int, device: torch.device) -> int:
    """K splits that give an [N, K] product about PROGRAMS_PER_SM programs per SM."""
    blocks = triton.cdiv(n, config(n)[0])
    return max(1, min(MAX_SPLITS, PROGRAMS_PER_SM * _sms(device) // blocks, k // MIN_SPLIT_K))


def splits_for(n: int, k: int, device: torch.device) -> int:
    """The K splits ``launch_gemv`` takes for an [N, K] weight: 1 (no split) unless ``SPLIT_K``."""
    return balanced_splits(n, k, device) if SPLIT_K else 1


class Plan(NamedTuple):
    """A launch's tiles: splits of K_SPLIT inputs (a multiple of BLOCK_K; the last may be short)."""

    blocks: int  # column blocks of BLOCK_N
    block_n: int
    block_k: int
    k_split: int
    splits: int
    even_k: bool
    num_warps: int
    num_stages: int


def plan(n: int, k: int, splits: int, tiles: tuple[int, int, int, int] | None = None) -> Plan:
    """Tiles for ``splits`` splits of K; the largest BLOCK_K that keeps that many, else fewer.
    ``tiles``: (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, NUM_STAGES) in place of ``config(n)``."""
    block_n, max_block_k, num_warps, num_stages = tiles or config(n)
    block_k = min(max_block_k, max(16, triton.next_power_of_2(triton.cdiv(k, splits))))
    while True:
        k_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
        if triton.cdiv(k, k_split) == splits or block_k == 16:
            break
        block_k //= 2
    blocks = triton.cdiv(n, block_n)
    return Plan(blocks, block_n, block_k, k_split, triton.cdiv(k, k_split), k % block_k == 0, num_warps,
                num_stages)  # fmt: skip


_TICKETS: dict[torch.device, torch.Tensor] = {}


def tickets(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 counters, made on first use (an eager call, before any capture:
    a buffer made inside a capture would live in the graph's pool)."""
    if device not in _TICKETS:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "the first split-K launch on a device must run eagerly, before capture"
        _TICKETS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before any stream draws a ticket
    return _TICKETS[device]


def check_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M <= MAX_M, K] and w [N, K] of one bf16/fp16 dtype, with unit inner strides."""
    m, k = x.shape
    shapes = f"x {tuple(x.shape)} and w {tuple(w.shape)}: need [M <= {MAX_M}, K] and [N, K]"
    assert w.dim() == 2 and w.shape[1] == k and 0 < m <= MAX_M, shapes
    assert x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16), (
        f"x and w must share a bf16/fp16 dtype, got {x.dtype} and {w.dtype}"
    )
    return x if x.stride(-1) == 1 else x.contiguous(), w if w.stride(-1) == 1 else w.contiguous()


def launch_gemv(x: torch.Tensor, w: torch.Tensor, splits: int = 0) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x's dtype, over ``splits`` K splits (0: ``splits_for``);
    checks and launches without the device check (the Triton interpreter runs it on CPU tensors)."""
    x, w = check_operands(x, w)
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    p = plan(n, k, splits or splits_for(n, k, x.device))
    common = dict(M_P=MAX_M, BLOCK_N=p.block_n, BLOCK_K=p.block_k, EVEN_K=p.even_k,
                  num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args(x))  # fmt: skip
    if p.splits == 1:
        _gemv_kernel[(p.blocks,)](
            x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), **common
        )  # fmt: skip
        return out
    assert p.blocks <= COUNTERS and p.splits * m * n < 2**31, f"N={n} x M={m} too large to split"
    ws = torch.empty(p.splits, m, n, dtype=torch.float32, device=x.device)  # the partials
    _gemv_split_k_kernel[(p.blocks, p.splits)](
        x, w, out, ws, tickets(x.device), m, n, k, p.k_split, x.stride(0), w.stride(0), out.stride(0),
        SPLITS=p.splits, **common,
    )  # fmt: skip
    return out


def check_norm_operands(x: torch.Tensor, residual: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor):
    """A folded norm's operands beside x [M, K]: residual and h (the sum's buffer) of x's shape and
    dtype with unit inner strides, the norm's weight [K]."""
    assert residual.shape == x.shape == h.shape and residual.dtype == x.dtype == h.dtype, (
        f"the folded norm's residual {tuple(residual.shape)} {residual.dtype} and h {tuple(h.shape)} "
        f"{h.dtype} must match x {tuple(x.shape)} {x.dtype}"
    )
    assert norm_weight.shape == (x.shape[1],), (
        f"norm weight {tuple(norm_weight.shape)} does not fit K={x.shape[1]}"
    )
    assert residual.stride(-1) == 1 and h.stride(-1) == 1, "the residual and h need unit inner strides"


def launch_normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    w: torch.Tensor,
    h: torch.Tensor,
) -> torch.Tensor:
    """``rms_norm(x + residual) @ w.T`` with the norm folded into the product (``normed_gemv_tile``):
    x, residual [M, K], norm_weight [K], w [N, K] -> [M, N]; writes x + residual into h [M, K].
    Without the device check (the interpreter runs it)."""
    x, w = check_operands(x, w)
    (m, k), n = x.shape, w.shape[0]
    check_norm_operands(x, residual, h, norm_weight)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    p = plan(n, k, 1, normed_config(n))
    _normed_gemv_kernel[(p.blocks,)](
        x, residual, norm_weight, h, w, out, m, n, k, eps, x.stride(0), residual.stride(0), h.stride(0),
        w.stride(0), out.stride(0), M_P=MAX_M, T_P=norm_rows(m), BLOCK_N=p.block_n,
        BLOCK_K=p.block_k, EVEN_K=p.even_k, ZERO_CENTERED=zero_centered, num_warps=p.num_warps,
        num_stages=p.num_stages, **pdl_args(x),
    )  # fmt: skip
    return out


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``launch_gemv`` on CUDA tensors; graph-capturable (the grid comes from shapes)."""
    assert x.is_cuda and w.device == x.device, "gemv needs CUDA tensors on one device"
    return launch_gemv(x, w)
