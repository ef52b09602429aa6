"""The token -> expert sort of the grouped MoE GEMMs: (token, k) pairs in runs by expert, each run
padded to a multiple of BLOCK_M rows, and each row block's expert (``align_by_expert``).

Shapes are fixed by (T, k, E) and nothing waits for the host, so a decode step's sort is captured
in its CUDA graph: up to ``small`` pairs one program does it all, above three launches. Not here:
the GEMMs that read the sort (``triton_moe``, ``triton_w4a16``, ``gluon_w4a16``), the MoE GEMV's
decode path, which needs none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous

ALIGN_BLOCK = 1024  # pairs per program of the multi-program sort (prefill sizes)
# the narrowest expert axis the alignment kernels are compiled for (their [CHUNK, E_P] compares
# cost next to nothing): banks of up to this many rows share one variant
ALIGN_MIN_EXPERTS = 256


@triton.jit
def _blocks_and_padding(
    padded, ends, sorted_ids, block_expert, num_padded, N, EM, E,
    BM: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    # from each expert's padded run length and end row: the rows in use, each BM-row block's
    # expert (a searchsorted), and every row set to the padding pair id N
    c = tl.arange(0, CHUNK)
    tl.store(num_padded, tl.sum(padded, 0).to(tl.int64))
    for b0 in range(0, EM // BM, CHUNK):
        blk = b0 + c
        owner = tl.sum((ends[None, :] <= (blk * BM)[:, None]).to(tl.int32), 1)  # searchsorted right
        tl.store(block_expert + blk, tl.minimum(owner, E - 1).to(tl.int64), mask=blk < EM // BM)
    f = tl.arange(0, FILL)
    for r0 in range(0, EM, FILL):
        tl.store(sorted_ids + r0 + f, tl.zeros([FILL], tl.int64) + N, mask=r0 + f < EM)


@triton.jit(do_not_specialize=["N", "E"], do_not_specialize_on_alignment=["ids"])
def _align_kernel(
    ids, sorted_ids, block_expert, num_padded, N, EM, E,
    E_P: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    # one program does the whole sort for small T*k (decode): one launch instead of a dozen
    ex = tl.arange(0, E_P)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P], tl.int32)
    for i0 in range(0, N, CHUNK):
        e = tl.load(ids + i0 + c, mask=i0 + c < N, other=E_P).to(tl.int32)  # E_P matches no expert
        counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), 0)
    padded = tl.cdiv(counts, BM) * BM
    ends = tl.cumsum(padded, 0)  # [E_P] end row of each expert's run
    _blocks_and_padding(padded, ends, sorted_ids, block_expert, num_padded, N, EM, E, BM, CHUNK, FILL)
    tl.debug_barrier()  # the padding fill above must land before the pair ids below
    next_row = ends - padded  # [E_P] next free row of each expert
    for i0 in range(0, N, CHUNK):
        i = i0 + c
        e = tl.load(ids + i, mask=i < N, other=E_P).to(tl.int32)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)  # [CHUNK, E_P]
        earlier = tl.cumsum(hit, 0) - hit  # same-expert pairs before this one in the chunk
        dest = tl.sum(hit * (earlier + next_row[None, :]), 1)
        tl.store(sorted_ids + dest, i.to(tl.int64), mask=i < N)
        next_row += tl.sum(hit, 0)


@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["ids"])
def _count_kernel(ids, counts, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids + i, mask=i < N, other=0)
    tl.atomic_add(counts + e, 1, mask=i < N)


@triton.jit(do_not_specialize=["N", "E"])
def _runs_kernel(
    counts, next_row, sorted_ids, block_expert, num_padded, N, EM, E,
    E_P: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    ex = tl.arange(0, E_P)
    padded = tl.cdiv(tl.load(counts + ex, mask=ex < E, other=0), BM) * BM
    ends = tl.cumsum(padded, 0)
    tl.store(next_row + ex, ends - padded, mask=ex < E)
    _blocks_and_padding(padded, ends, sorted_ids, block_expert, num_padded, N, EM, E, BM, CHUNK, FILL)


@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["ids"])
def _place_kernel(ids, next_row, sorted_ids, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids + i, mask=i < N, other=0)
    dest = tl.atomic_add(next_row + e, 1, mask=i < N)  # a free row of the pair's expert run
    tl.store(sorted_ids + dest, i.to(tl.int64), mask=i < N)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, small: int = 1024):
    """Sort the T*k (token, slot) pairs by expert and pad each expert's run to a multiple of block_m.

    Returns sorted_ids [EM] (flat pair ids, T*k marks padding), block_expert [EM/block_m] and
    num_padded [1] (rows in use). EM bounds the padded length from shapes alone: at most
    min(E, T*k) experts are hit, each wasting at most block_m - 1 rows. Up to ``small`` pairs one
    Triton program does it all, in pair order within each expert; above, three launches (count
    with atomics, lay out the runs, place each pair at an atomically taken row of its run), so a
    run's order varies between calls. That cannot change a result: each GEMM row is computed
    alone, with the same reduction order wherever it sits in its tile.

    ``num_experts`` is a run-time argument of the kernels, and the width compiled in is its power
    of two but at least ``ALIGN_MIN_EXPERTS``: a bank's rows are not always the model's experts
    (the offload backend's pre-staged buffers hold as many as a layer had room for), and each new
    count, or power of two, compiled the kernels again inside the forward that met it (pre-staging's
    slow first TTFT runs on an H200, 2026-12-03: docs/benchmarks.md). The pair count ``N`` is not
    specialised on, nor the expert count (Triton would compile apart a value of 1 and multiples of 16),
    nor the alignment of ``ids`` (the offload backend's calls take slices of a batch's pairs), for
    the same reason.
    """
    flat = ids.reshape(-1).contiguous()  # [N]
    n = flat.numel()
    em = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.empty(em, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(em // block_m, dtype=torch.int64, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int64, device=ids.device)
    e_p = max(ALIGN_MIN_EXPERTS, triton.next_power_of_2(num_experts))
    shape = dict(E=num_experts, E_P=e_p, BM=block_m, CHUNK=32, FILL=1024)
    if n <= small:
        _align_kernel[(1,)](
            flat, sorted_ids, block_expert, num_padded, n, em, **shape, num_warps=8, **pdl_args(flat)
        )
        return sorted_ids, block_expert, num_padded
    counts, next_row = torch.zeros(2, num_experts, dtype=torch.int32, device=ids.device)
    grid = (triton.cdiv(n, ALIGN_BLOCK),)
    _count_kernel[grid](flat, counts, n, BLOCK=ALIGN_BLOCK)
    _runs_kernel[(1,)](counts, next_row, sorted_ids, block_expert, num_padded, n, em, **shape, num_warps=8)
    _place_kernel[grid](flat, next_row, sorted_ids, n, BLOCK=ALIGN_BLOCK)
    return sorted_ids, block_expert, num_padded
