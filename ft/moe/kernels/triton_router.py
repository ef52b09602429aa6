"""The top-k softmax router in one Triton kernel: one program per token row.

    p   = softmax(logits)                     # fp32, over all E experts
    ids = the k largest logits, largest first (softmax is monotone, so these are p's top k)
    w   = p[ids]  or, renormalised,  p[ids] / sum(p[ids])

Same contract as ``ft.moe.router.route`` (softmax, ``torch.topk``, sum, divide: about six
kernels), whose results it equals: the same ids, weights to fp32 rounding. The k picks are k
max-reductions over one int64 key per expert,

    key = sortable(logit) · 2^32 + (E_P - 1 - expert)

where ``sortable`` flips the low 31 bits of a negative fp32 so that signed-integer order is
float order. One reduction gives both the largest logit and, among equal logits, the lowest
expert id (a fixed tie order; ``torch.topk`` leaves it unspecified). The logit comes back out
of the key exactly, so the weights are computed for the k picks alone. Rows are padded to a
power of two with -inf. The maths is ``softmax_topk_rows``, on a block of rows, which
``triton_router_gemv`` also runs as the epilogue of the router's GEMV. Not here: grouped routing
(DeepSeek's expert groups), sigmoid scoring, score bias terms.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous

MAX_EXPERTS = 4096  # one row lives in one program's registers
# bf16 logits picked with int32 keys (``softmax_topk_rows``: the same picks, reductions half as
# wide), here and in the fused router's epilogue (compiled for sm_90: 2,152 -> 1,640 instructions).
# On from 2026-12-01 (FT_ROUTER_KEYS32=0 turns it off for a process and the ranks it spawns): the
# same ids and weights bit for bit (tests/gpu/test_router_fold.py), the 80B's batch-1 decode with
# NVFP4 experts on an H200 287.3 -> 291.0 tok/s, the same greedy tokens (docs/benchmarks.md).
KEYS32 = os.environ.get("FT_ROUTER_KEYS32", "1") != "0"
MAX_TOP_K = 64  # the k passes are unrolled


def keys32(dtype: torch.dtype) -> bool:
    """Whether logits of ``dtype`` are picked with int32 keys (``KEYS32``: bf16 only)."""
    return KEYS32 and dtype == torch.bfloat16


@triton.jit
def softmax_topk_rows(x, K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, RENORMALIZE: tl.constexpr,
                      KEYS32: tl.constexpr = False):  # fmt: skip
    # x [R, E_P] fp32 logits, padded with -inf -> (weights [R, K_P] fp32, ids [R, K_P] int64), the
    # k picks largest first in slots 0 .. K-1 (the fused router's epilogue runs this too). Each pick
    # is one max over keys (the logit's order bits, then the expert reversed: ties go to the lower
    # expert). With KEYS32 the logits are bf16 values (their fp32 low 16 bits zero), so a key is
    # their 16 order bits and 16 of the expert's in an int32, the same picks as the int64 keys
    # with reductions of half the width.
    e = tl.arange(0, E_P)[None, :]
    m = tl.max(x, 1)[:, None]
    total = tl.sum(tl.exp(x - m), 1)[:, None]  # the softmax denominator
    bits = x.to(tl.int32, bitcast=True)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # sortable: signed order == float order
    if KEYS32:  # a negative value's order has 0xFFFF below, a positive's 0: the top half decides
        key = (order & -65536) | (E_P - 1 - e)  # [R, E_P] int32, distinct in a row
        lowest = -0x7FFFFFFF - 1
    else:
        key = (order.to(tl.int64) << 32) | (E_P - 1 - e).to(tl.int64)  # [R, E_P], distinct in a row
        lowest = -0x7FFFFFFFFFFFFFFF
    slot = tl.arange(0, K_P)[None, :]
    picked = tl.full([x.shape[0], K_P], -float("inf"), tl.float32)  # the k largest logits
    picked_ids = tl.zeros([x.shape[0], K_P], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, 1)[:, None]  # [R, 1]
        if KEYS32:
            hi = best & -65536
            logit = ((hi ^ ((hi >> 31) & 0x7FFFFFFF)) & -65536).to(tl.float32, bitcast=True)
            low = (best & 0xFFFF).to(tl.int64)  # E_P - 1 - expert
        else:
            hi = (best >> 32).to(tl.int32)
            logit = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)  # the flip undone
            low = best - (hi.to(tl.int64) << 32)  # E_P - 1 - expert
        picked = tl.where(slot == j, logit, picked)
        picked_ids = tl.where(slot == j, E_P - 1 - low, picked_ids)
        key = tl.where(key == best, lowest, key)  # below every real key
    p = tl.exp(picked - m) / total  # [R, K_P] softmax of the picks; padded slots are exp(-inf) = 0
    if RENORMALIZE:
        p = p / tl.sum(p, 1)[:, None]
    return p, picked_ids


@triton.jit
def _softmax_topk_kernel(
    logits,
    weights,
    ids,
    E,
    s_l,
    K: tl.constexpr,
    K_P: tl.constexpr,
    E_P: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    KEYS32: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P)[None, :]
    x = tl.load(logits + row * s_l + e, mask=e < E, other=-float("inf")).to(tl.float32)  # [1, E_P]
    p, picked_ids = softmax_topk_rows(x, K, K_P, E_P, RENORMALIZE, KEYS32)
    slot = tl.arange(0, K_P)[None, :]
    out = row * K + slot
    tl.store(weights + out, p, mask=slot < K)
    tl.store(ids + out, picked_ids, mask=slot < K)


def launch_softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch without the device check (the Triton interpreter runs it on CPU tensors)."""
    t, e = logits.shape
    assert 1 <= top_k <= min(e, MAX_TOP_K), f"top_k={top_k} must be in [1, min(E={e}, {MAX_TOP_K})]"
    assert e <= MAX_EXPERTS, f"E={e} experts exceed the {MAX_EXPERTS} one program holds"
    assert logits.is_floating_point(), f"logits must be floating point, got {logits.dtype}"
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    e_p = triton.next_power_of_2(e)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t > 0:
        _softmax_topk_kernel[(t,)](
            logits,
            weights,
            ids,
            e,
            logits.stride(0),
            K=top_k,
            K_P=triton.next_power_of_2(top_k),
            E_P=e_p,
            RENORMALIZE=renormalize,
            KEYS32=keys32(logits.dtype),
            num_warps=max(1, min(8, e_p // 512)),  # E <= 512: one warp, reductions are shuffles
            **pdl_args(logits),
        )
    return weights, ids


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, k] fp32, ids [T, k] int64), largest first."""
    assert logits.is_cuda and logits.dim() == 2, (
        f"softmax_topk needs CUDA logits [T, E], got {tuple(logits.shape)} on {logits.device}"
    )
    return launch_softmax_topk(logits, top_k, renormalize)
