"""The router's GEMV with the top-k softmax as its epilogue, one launch for a decode batch.

The unfused router is two kernels: ``dense`` (logits = x @ W.T, the Triton GEMV: 513 x 2048 for
Qwen3-Next, 33 programs, ~4.9 us on an H200 for 2.1 MB) and ``softmax_topk`` (~3.7 us more).
Here the GEMV runs split over K as ``triton_gemv``'s split kernel does (grid: column blocks x
splits, fp32 partials in a workspace, a ticket per column block), so the 2.1 MB are read by
about two programs per SM. The column block's last program sums its partials in split order,
rounds the logits to x's dtype and stores them, exactly the logits ``dense`` returns when it
splits the same way; then it draws a ticket from one more counter, shared by the launch's
column blocks. The program with the last of those reads the whole [T, E (+ 1)] logits back
and runs ``triton_router.softmax_topk_rows`` on all T rows at once: the same ids as
``dense`` + ``softmax_topk`` given the same logits, weights to fp32 rounding (the softmax
denominator's sum order may differ). It resets both counters it used.

The logits buffer is an output: the shared expert's gate logit (weight row E, last) is its
[T, 1] column view, in x's dtype, as ``TopKRouter`` returns it. With a pre-norm folded in
(``norm``, ``ft.layers.norm.FOLD_POST_NORM``) the logits are those of the normed input up to
rounding: 1 / rms multiplies the products' sum (``gemv_tiles.normed_split_k_sum``), not the
inputs, so a near tie in the top k can fall the other way; the normed input the launch writes is
the norm kernel's up to the order 1 / rms was summed in. Not here: more than ``MAX_TOKENS`` tokens
(one program's registers hold every row's keys), fp32 activations.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.layers import gemv_tiles, triton_gemv
from ft.layers.norm import FoldedNorm
from ft.layers.pdl import pdl_args, wait_for_previous
from ft.moe.kernels import int_dot, triton_router
from ft.moe.kernels.triton_router import MAX_EXPERTS, MAX_TOP_K, softmax_topk_rows

# On from 2026-12-01 (FT_FUSED_ROUTER=0 turns it off for a process and the ranks it spawns), one
# launch fewer a layer: the 80B's batch-1 decode with NVFP4 experts on an H200, two calls, on
# 299.9 / 294.4 and 293.3 / 293.4 tok/s against off 283.8 / 283.2 and 297.1 / 281.6 / 297.5 / 291.9
# (docs/benchmarks.md, 18:30-19:00 UTC): about 2%, near the rows' spread. On the 24-layer bf16
# model of 2026-11-30 it had gained nothing (482.8 against 482.9). GPU tests:
# tests/gpu/test_router_fold.py, and test_engine_cuda.py's decode-switch tolerance (both passed).
FUSED_ROUTER = os.environ.get("FT_FUSED_ROUTER", "1") != "0"
MAX_TOKENS = 4  # the epilogue's program holds T x E_P keys (int64, or int32 with triton_router.KEYS32)


@triton.jit
def _router_topk_kernel(
    x, w, logits, weights, ids, ws, counters, xq, xf, r, nw, h, a, squares_ws, M, N, E, K, K_SPLIT, SLICE,
    eps, s_xm, s_wn, s_qt, s_ft, s_rm, s_hm, s_am,
    M_P: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_K: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr,
    E_P: tl.constexpr, RENORMALIZE: tl.constexpr, KEYS32: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    BLOCKS: tl.constexpr = False, NORM: tl.constexpr = False, ZERO_CENTERED: tl.constexpr = False,
    NORM_ROWS: tl.constexpr = 2,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    last, total, squares = gemv_tiles.normed_split_k_sum(
        x, r, nw, h, w, ws, squares_ws, counters, n, M, N, K, K_SPLIT, s_xm, s_rm, s_hm, s_wn, M_P, NORM_ROWS,
        BLOCK_N, BLOCK_K, SPLITS, EVEN_K, NORM, ZERO_CENTERED,
    )  # fmt: skip
    if BLOCKS and not NORM:  # noqa: SIM102 (static) the first column block of each split quantises
        # the inputs it read, x's int16 blocks for the MoE GEMV
        if tl.program_id(0) == 0:
            k_lo = tl.program_id(1) * K_SPLIT
            k_hi = tl.minimum(K, k_lo + K_SPLIT)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                int_dot.quantize_range(x, xq, xf, M, k0, k_hi, s_xm, s_qt, s_ft, T_P, BLOCK_K)
    if last:
        m = tl.arange(0, M_P)
        inv = tl.rsqrt(squares / K + eps)  # with NORM: the norm's 1 / rms [M_P, 1], applied to the products
        if NORM:
            total = total * inv
        mask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(logits + m[:, None] * N + n[None, :], total.to(logits.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # every thread's logits before the launch ticket's release
        blocks = tl.num_programs(0)
        ticket = tl.atomic_add(counters + blocks, 1, sem="acq_rel")
        if ticket == blocks - 1:  # every column block's logits are stored
            t = tl.arange(0, T_P)[:, None]
            e = tl.arange(0, E_P)[None, :]
            row = tl.load(logits + t * N + e, mask=(t < M) & (e < E), other=-float("inf"),
                          cache_modifier=".cg").to(tl.float32)  # [T_P, E_P]  # fmt: skip
            row = tl.where(t < M, row, 0.0)  # padding tokens: finite, never stored
            p, picked_ids = softmax_topk_rows(row, TOP_K, TOP_K_P, E_P, RENORMALIZE, KEYS32)
            slot = tl.arange(0, TOP_K_P)[None, :]
            out = t * TOP_K + slot
            tl.store(weights + out, p, mask=(t < M) & (slot < TOP_K))
            tl.store(ids + out, picked_ids, mask=(t < M) & (slot < TOP_K))
            tl.store(counters + blocks, 0)
        if NORM:  # the normed input itself for the MoE, this column block's SLICE of it
            lo = tl.program_id(0) * SLICE
            hi = tl.minimum(K, lo + SLICE)
            for k0 in range(lo, hi, 16):
                normed_slice(x, r, nw, a, inv, M, k0, hi, s_xm, s_rm, s_am, M_P, ZERO_CENTERED)
            if BLOCKS:  # and its int16 blocks, read back from a (this program's own stores)
                tl.debug_barrier()
                for k0 in range(lo, hi, 16):
                    int_dot.quantize_range(a, xq, xf, M, k0, hi, s_am, s_qt, s_ft, T_P, 16)


@triton.jit
def normed_slice(
    x, r, nw, a, inv, M, k0, k_hi, s_xm, s_rm, s_am, M_P: tl.constexpr, ZERO_CENTERED: tl.constexpr
):
    # a[:, k0 : k0 + 16] = rms_norm(x + r) there, as triton_norm rounds it, given the rows' 1 / rms
    # inv [M_P, 1] (summed in another order than the norm kernel's: an ulp apart at most)
    m = tl.arange(0, M_P)[:, None].to(tl.int64)
    k = k0 + tl.arange(0, 16)[None, :]
    mask = (m < M) & (k < k_hi)
    ht = tl.load(x + m * s_xm + k, mask=mask, other=0.0)
    ht = (ht.to(tl.float32) + tl.load(r + m * s_rm + k, mask=mask, other=0.0).to(tl.float32)).to(ht.dtype)
    wn = tl.load(nw + k, mask=k < k_hi, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        wn = wn + 1.0
    tl.store(a + m * s_am + k, (ht.to(tl.float32) * inv * wn).to(a.dtype.element_ty), mask=mask)


def takes_fused(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``TopKRouter`` routes x over w here: the switch on, a decode batch on a GPU, bf16/fp16."""
    return (
        FUSED_ROUTER
        and x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_TOKENS
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def launch_router_topk(
    x: torch.Tensor,
    w: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_gate: bool,
    splits: int = 0,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm: FoldedNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, H], w [E (+ 1), H] (the shared gate's row last) -> (weights [T, k] fp32, ids [T, k]
    int64, largest first; the gate logit [T, 1] in x's dtype or None), over ``splits`` K splits
    (0: ``triton_gemv.balanced_splits``). ``blocks``: buffers (``int_dot.empty_blocks``)
    the launch also fills with x's int16 blocks (``int_dot.quantize_range``), for the MoE
    GEMV's integer products. ``norm``: route ``rms_norm(x + norm.residual)`` instead of x, the norm
    folded into the GEMV, writing x + residual into ``norm.h``, the normed input into ``norm.a``
    and the blocks of that. Without the device check (the interpreter runs it)."""
    x, w = triton_gemv.check_operands(x, w)
    (t, h), n = x.shape, w.shape[0]
    e = n - shared_gate
    assert 0 < t <= MAX_TOKENS, f"{t} tokens: the fused router takes 1 .. {MAX_TOKENS}"
    assert 1 <= top_k <= min(e, MAX_TOP_K), f"top_k={top_k} must be in [1, min(E={e}, {MAX_TOP_K})]"
    assert e <= MAX_EXPERTS, f"E={e} experts exceed the {MAX_EXPERTS} one program holds"
    p = triton_gemv.plan(n, h, splits or triton_gemv.balanced_splits(n, h, x.device))
    assert p.blocks < triton_gemv.COUNTERS and p.splits * t * n < 2**31, f"N={n} too large to split"
    logits = torch.empty(t, n, dtype=x.dtype, device=x.device)  # [T, E (+ 1)]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    ws = torch.empty(p.splits, t, n, dtype=torch.float32, device=x.device)  # the partials
    xq, xf = blocks if blocks is not None else (x, x)  # unwritten without blocks
    r, nw, hs, a = x, x, x, x  # unread without a norm
    if norm is not None:
        r, nw, hs, a = norm.residual, norm.weight, norm.h, torch.empty_like(x)
        triton_gemv.check_norm_operands(x, r, hs, nw)
        squares = torch.empty(p.blocks, p.splits, triton_gemv.MAX_M, dtype=torch.float32, device=x.device)
        norm.a = a
    slice_ = triton.cdiv(triton.cdiv(h, 16), p.blocks) * 16  # each column block's share of the normed input
    _router_topk_kernel[(p.blocks, p.splits)](
        x, w, logits, weights, ids, ws, triton_gemv.tickets(x.device), xq, xf, r, nw, hs, a,
        ws if norm is None else squares, t, n, e, h, p.k_split, slice_, 0.0 if norm is None else norm.eps,
        x.stride(0), w.stride(0), xq.stride(0), xf.stride(0), r.stride(0), hs.stride(0), a.stride(0),
        BLOCKS=blocks is not None, NORM=norm is not None, NORM_ROWS=gemv_tiles.norm_rows(t),
        ZERO_CENTERED=norm is not None and norm.zero_centered,
        M_P=triton_gemv.MAX_M, T_P=triton.next_power_of_2(t),
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, SPLITS=p.splits, EVEN_K=p.even_k, TOP_K=top_k,
        TOP_K_P=triton.next_power_of_2(top_k), E_P=triton.next_power_of_2(e), RENORMALIZE=renormalize,
        KEYS32=triton_router.keys32(logits.dtype),
        num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args(x),
    )  # fmt: skip
    return weights, ids, logits[:, e:] if shared_gate else None


def router_topk(
    x: torch.Tensor,
    w: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_gate: bool,
    blocks: bool = False,
    norm: FoldedNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``launch_router_topk`` on CUDA tensors; graph-capturable (the grid comes from shapes). With
    ``blocks`` the routed input's int16 blocks are left on it for the MoE GEMV
    (``int_dot.BLOCKS_ATTR``): on x, or with ``norm`` on ``norm.a``."""
    assert x.is_cuda and w.device == x.device, "router_topk needs CUDA tensors on one device"
    made = int_dot.empty_blocks(x) if blocks else None
    out = launch_router_topk(x, w, top_k, renormalize, shared_gate, blocks=made, norm=norm)
    if made is not None:
        setattr(x if norm is None else norm.a, int_dot.BLOCKS_ATTR, made)
    return out
