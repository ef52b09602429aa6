"""Host staging: a host-read decode layer's host experts copied by one GPU kernel into a small
device block right before its MoE kernels, which then read every expert from device memory.

With host reads (``host_reads.py``) the MoE kernels read a layer's missed experts from the pinned
host store over PCIe themselves, at a rate their access pattern sets. On an H200 (2026-12-03,
docs/benchmarks.md) ten NVFP4 experts read in place took 531-559 us a call: the gate/up kernel read
its host rows at 45 GB/s, the down kernel at 24 (under Nsight Compute its host read requests
carried half the sectors of gate/up's), where a DMA copy of the same bytes took 327 us (55 GB/s)
and a kernel streaming random 6 MB blocks in place read 51 GB/s (tests/gpu/zero_copy_bandwidth.py).

With staging on (``stages``), ``stage`` runs once a layer, after its routing and before its MoE kernels, one
kernel of a program per (pair, 16 KB of a row): each pair whose route sends it to the host store
(row r >= 0 as -(r + 1)) has that whole row (every part of the expert) copied into the
``StageBlock`` row of the first pair reading it (so an expert two tokens share crosses PCIe once),
and its id pointed there, -(staging row + 1). The MoE kernels take the block as their host
operand: the same bytes reach the same arithmetic, so the result is bit for bit that of reading
in place; over PCIe each host expert's row crosses once (``HostReads`` counts it once, where
reading in place counts it for every pair that reads it). Nothing waits for the host, so
the step stays one CUDA graph. One block serves every layer of the rank (each layer's copy and
kernels run in stream order); its rows are pairs of the largest batch host reads take, and the
plan takes its bytes from the expert cache's share (142 MB for the NVFP4 80B: 8 tokens x 10).

Not staged: a layer whose down kernel reads other rows than its gate/up kernel (a down-only host
prefetch, ``host_prefetch.py``) reads in place.

Timed on an H200 (2026-12-03 23:50 UTC, docs/benchmarks.md), ten experts on the host: NVFP4 509.8 us
read in place against 377.6 staged (360.4 the copy at 49.4 GB/s, 17 the call on device rows), so
``NVFP4_STAGE`` is on (the 80B under 48 GiB, batch 1: 140.1 -> 144.4 tok/s at the same 78.7% hit
rate); bf16 1,238.8 in place against 1,306.6 staged (its kernels read the host at 51-52 GB/s
already), so ``STAGE``, the bf16 banks' switch, stays off. FT_MOE_HOST_STAGE=0/1 sets both for a
process (read when the engine builds its offload state, which allocates the block, and at each call).
"""

from __future__ import annotations

import os

import torch

from ft.moe.backends.layout import ExpertLayout

STAGE = os.environ.get("FT_MOE_HOST_STAGE", "0") == "1"  # bf16 banks
NVFP4_STAGE = os.environ.get("FT_MOE_HOST_STAGE", "1") == "1"
STAGE_BLOCK = 2048  # int64 words a program copies (16 KB)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machine: the torch version of ``stage``
    triton = None


def stages(fmt: str | None) -> bool:
    """Whether host-read layers of a bank of format ``fmt`` stage their host experts (the switch
    as it is now)."""
    return NVFP4_STAGE if fmt == "nvfp4" else STAGE


class StageBlock:
    """Device rows laid out as the host store, one per (token, expert) pair of the largest batch
    that host reads take; ``tensors`` are their views, the MoE kernels' host operand."""

    def __init__(self, layout: ExpertLayout, pairs: int, device: torch.device) -> None:
        self.block = layout.allocate(pairs, device)  # [pairs, expert_bytes]
        self.tensors = layout.views(self.block)

    @property
    def pairs(self) -> int:
        return self.block.shape[0]

    @property
    def nbytes(self) -> int:
        return self.block.numel()


def plan(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [T, k] (a slot, or -(host row + 1)) -> (the host row each staging row takes [T*k]
    int64, -1 for none; the rows with each host one pointed at its staging row [T, k]): the torch
    version (CPU, and the kernel's oracle). A host row goes to the staging row of the first pair
    (in row-major order) reading it."""
    flat = rows.reshape(-1)
    pair = torch.arange(len(flat), device=rows.device)
    host = flat < 0
    same = (flat[:, None] == flat[None, :]) & host[:, None]  # [P, P]: pair q reads p's host row
    first = torch.where(same, pair[None, :], len(flat)).min(1).values  # p itself at the latest
    src = torch.where(host & (first == pair), -flat - 1, -1)
    staged = torch.where(host, -first - 1, flat)
    return src, staged.view(rows.shape)


def stage(rows: torch.Tensor, store_block: torch.Tensor, staging: StageBlock) -> torch.Tensor:
    """Copy the host rows that ``rows`` [T, k] reads from ``store_block`` (the host store's
    ``[n, expert_bytes]`` uint8) into ``staging``; returns the rows pointing at them there."""
    pairs = rows.numel()
    assert pairs <= staging.pairs, f"{pairs} pairs, a staging block of {staging.pairs} rows"
    assert store_block.shape[1] == staging.block.shape[1], "the staging rows are laid out as the store's"
    if rows.is_cuda and triton is not None:
        words = store_block.shape[1] // 8
        staged = torch.empty_like(rows)
        _stage_kernel[(pairs, triton.cdiv(words, STAGE_BLOCK))](
            rows.contiguous(), staged, store_block.view(torch.int64), staging.block.view(torch.int64), words,
            pairs, BLOCK_P=max(16, triton.next_power_of_2(pairs)), BLOCK=STAGE_BLOCK,
        )  # fmt: skip
        return staged
    src, staged = plan(rows)
    take = src >= 0
    staging.block[: len(src)][take] = store_block[src[take].to(store_block.device)].to(staging.block.device)
    return staged


if triton is not None:

    @triton.jit
    def _stage_kernel(
        rows, staged, src_block, dst_block, WORDS, P, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        # program (pair i, chunk c): chunk c of pair i's host row into staging row i if i is the
        # first pair reading that row; chunk 0's program writes pair i's staged id
        i = tl.program_id(0)
        c = tl.program_id(1)
        p = tl.arange(0, BLOCK_P)
        all_rows = tl.load(rows + p, mask=p < P, other=0)
        mine = tl.load(rows + i)
        first = tl.min(tl.where((all_rows == mine) & (p < P), p, BLOCK_P), 0)  # i itself at the latest
        if c == 0:
            tl.store(staged + i, tl.where(mine < 0, -first - 1, mine))
        if (mine < 0) & (first == i):
            src = src_block + (-mine - 1).to(tl.int64) * WORDS
            dst = dst_block + i.to(tl.int64) * WORDS
            offs = c * BLOCK + tl.arange(0, BLOCK)
            m = offs < WORDS
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
