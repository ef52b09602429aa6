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
[T, 1] column view, in x's dtype, as ``TopKRouter`` returns it. Not here: more than
``MAX_TOKENS`` tokens (one program's registers hold every row's keys), fp32 activations.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.layers import gemv_tiles, triton_gemv
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
    x, w, logits, weights, ids, ws, counters, xq, xf, M, N, E, K, K_SPLIT, s_xm, s_wn, s_qt, s_ft,
    M_P: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_K: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr,
    E_P: tl.constexpr, RENORMALIZE: tl.constexpr, KEYS32: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    BLOCKS: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    block, split, blocks = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    # this column block's partial over its split; the column block's last program its logits; the
    # launch's last of those the top-k of every row (counters: a column block's tickets, then the
    # launch's). With BLOCKS column block 0 of each split also quantises the inputs it read (after
    # its ticket: ordered before their reader by the launch's end)
    last, total = gemv_tiles.split_k_sum(x, w, ws, counters, n, M, N, K, K_SPLIT, s_xm, s_wn, M_P,
                                         BLOCK_N, BLOCK_K, SPLITS, EVEN_K)  # fmt: skip
    if BLOCKS:  # noqa: SIM102 (static: compiled only with blocks) the first column block of each split
        # quantises the inputs it read, x's int16 blocks for the MoE GEMV
        if block == 0:
            k_lo, k_hi = gemv_tiles.split_range(K, K_SPLIT, split)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                int_dot.quantize_range(x, xq, xf, M, k0, k_hi, s_xm, s_qt, s_ft, T_P, BLOCK_K)
    if last:
        m = tl.arange(0, M_P)
        mask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(logits + m[:, None] * N + n[None, :], total.to(logits.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # every thread's logits before the launch ticket's release
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, H], w [E (+ 1), H] (the shared gate's row last) -> (weights [T, k] fp32, ids [T, k]
    int64, largest first; the gate logit [T, 1] in x's dtype or None), over ``splits`` K splits
    (0: ``triton_gemv.balanced_splits``). ``blocks``: buffers (``int_dot.empty_blocks``)
    the launch also fills with x's int16 blocks (``int_dot.quantize_range``), for the MoE
    GEMV's integer products. Without the device check (the interpreter runs it)."""
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
    _router_topk_kernel[(p.blocks, p.splits)](
        x, w, logits, weights, ids, ws, triton_gemv.tickets(x.device), xq, xf, t, n, e, h, p.k_split,
        x.stride(0), w.stride(0), xq.stride(0), xf.stride(0), BLOCKS=blocks is not None,
        M_P=triton_gemv.MAX_M, T_P=triton.next_power_of_2(t),
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, SPLITS=p.splits, EVEN_K=p.even_k, TOP_K=top_k,
        TOP_K_P=triton.next_power_of_2(top_k), E_P=triton.next_power_of_2(e), RENORMALIZE=renormalize,
        KEYS32=triton_router.keys32(logits.dtype),
        num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args(x),
    )  # fmt: skip
    return weights, ids, logits[:, e:] if shared_gate else None


def router_topk(
    x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, shared_gate: bool, blocks: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``launch_router_topk`` on CUDA tensors; graph-capturable (the grid comes from shapes). With
    ``blocks`` x's int16 blocks are left on x for the MoE GEMV (``int_dot.BLOCKS_ATTR``)."""
    assert x.is_cuda and w.device == x.device, "router_topk needs CUDA tensors on one device"
    made = int_dot.empty_blocks(x) if blocks else None
    out = launch_router_topk(x, w, top_k, renormalize, shared_gate, blocks=made)
    if made is not None:
        setattr(x, int_dot.BLOCKS_ATTR, made)
    return out
