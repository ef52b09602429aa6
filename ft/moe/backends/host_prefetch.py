"""Host reads' prefetch: a layer's likely host experts copied into spare cache rows while its
mixer runs, all on the device, inside the decode graph.

With host reads (``host_reads.py``) a decode step's MoE kernels read their missed experts over
PCIe themselves, so the link is busy only while a MoE kernel runs and idles through every
attention or GDN mixer, norm and router between them (on an H200, 2026-12-01, the full
Qwen3-Next-80B's bf16 step: 22 ms, of which ~13 ms of link time for its 711 MB a token).
``rows(format)`` = R > 0 gives each offloading layer R spare rows past its null slot (rows S + 1 ...
S + R) and, at the start of every host-read layer (``SparseMoeBlock.lookahead``, before the
mixer), on the main stream:

1. the layer's router on ``post_attention_layernorm(residual)``, the residual stream without the
   mixer's term: a guess at the MoE input -> ``pred`` [T, k] (on generated weights it finds 67%
   of the experts the layer then picks, 84% of its first two; the next layer's router on this
   layer's MoE input, the copying path's prefetch, finds 52% / 72%:
   tests/offload/prefetch_accuracy.py, 2026-12-01);
2. ``select``: of the predicted experts that the layer's route sends to the host (route < 0), the
   first R by rank (every token's first choice, then every token's second, ...), distinct,
   padding rows ignored -> the host rows to copy (-1: none), the layer's effective route (the
   picks pointed at the spare rows, every other expert as published), and the picks written into
   the layer's use counts (``HostReads.uses[:, E:]``, as expert + 1) for the statistics;

then on a side stream, after that point of the main stream, ``copy_rows`` copies those host rows
into the spare rows (a kernel of ``COPY_PROGRAMS`` programs reading the pinned host store through
unified addressing, few enough to leave the SMs to the mixer); the layer's MoE kernel waits for
it (an event) and reads its experts through the effective route. Nothing waits for the host, so
the step stays one CUDA graph. The bytes read are the same whichever row holds them, so the
result is bit for bit the same as without prefetch (or with a wrong guess, which costs link time,
never a result). The spare rows are rewritten only after the main stream passed their last
reader (the fork is ordered after it). Families whose layers are not ``DecoderLayer`` (qwen4_exp)
make no guess, so prefetch nothing.

``down_only(format)`` (bf16's ``DOWN_ONLY``; FT_MOE_HOST_PREFETCH_DOWN=0 copies whole experts):
only the picks' down projections (the row's bytes from its first ``w2`` part on, a third of a bf16
expert) are copied, and only the layer's down kernel waits for them and reads them there; its
gate/up kernel reads the picks from the host store as if unpicked, and runs while the copy
finishes. A whole
expert's copy (~0.23 ms for a bf16 one at 55 GB/s) outlasts the mixer it hides behind (~0.07
ms), so the MoE kernel used to wait most of it out, wrong guesses included; a down projection's
copy fits beside the mixer and the gate/up kernel that follows it. H200, 2026-12-02, the 16-layer
Qwen3-Next cut in bf16 under 48 GiB (86% of the experts resident), batch 1: no prefetch 212.0
tok/s, two rows down-only 212.4, three rows of whole experts 176.0 (docs/benchmarks.md): down-only
copies cost nothing that whole ones did, and they gain nothing either.

By format (``rows``, ``down_only``): bf16 banks prefetch nothing (``ROWS`` = 0), NVFP4 banks two
whole experts a layer (``NVFP4_ROWS``, ``NVFP4_DOWN_ONLY`` off). An NVFP4 expert (1.8 MB of the
80B's) copies in ~32 us, which a mixer hides where a bf16 one did not: H200, 2026-12-03, the full
Qwen3-Next-80B with NVFP4 experts under 48 GiB (79% resident, uniform routing, LRU), batch-1
decode 122.0 tok/s without prefetch, 127.0 with two rows down-only, **143.0** with two rows of
whole experts, 140.5 with four (docs/benchmarks.md). FT_MOE_HOST_PREFETCH=N sets N rows a layer
for both formats (0 turns it off) and FT_MOE_HOST_PREFETCH_DOWN=0/1 what they copy, each read
when the engine sizes its caches (the spare rows: offload backend with ``--moe-prefetch``) and at
each call (at most the rows sized; a captured graph keeps the value it was captured with). A
layer's uses of its picked experts count as misses (they are not cached); the statistics'
prefetched / prefetch hits count the picks and the picks the layer then read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# rows a layer and what they copy, bf16 banks then NVFP4 ones; read at each call (``rows``, ``down_only``)
ROWS = int(os.environ.get("FT_MOE_HOST_PREFETCH", "0"))
DOWN_ONLY = os.environ.get("FT_MOE_HOST_PREFETCH_DOWN", "1") != "0"
NVFP4_ROWS = int(os.environ.get("FT_MOE_HOST_PREFETCH", "2"))
NVFP4_DOWN_ONLY = os.environ.get("FT_MOE_HOST_PREFETCH_DOWN", "0") != "0"
COPY_PROGRAMS = 16  # programs of the copy kernel (each streams its share of every row)
COPY_BLOCK = 2048  # int64 words a program moves per iteration (16 KB)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machine: the torch versions below
    triton = None


def rows(fmt: str | None) -> int:
    """Spare rows a layer prefetches into for a bank of format ``fmt`` (the switch as it is now)."""
    return NVFP4_ROWS if fmt == "nvfp4" else ROWS


def down_only(fmt: str | None) -> bool:
    """Whether a bank of format ``fmt`` copies its picks' down projections alone."""
    return NVFP4_DOWN_ONLY if fmt == "nvfp4" else DOWN_ONLY


class Spare:
    """One layer's prefetch state: its spare rows, the route through them, the copy's event."""

    def __init__(self, cache, picks: torch.Tensor) -> None:
        dev = cache.device
        self.first_row = cache.map.num_slots + 1  # past the null row
        self.eff = torch.empty_like(cache.route)  # [E] the route with this step's picks
        self.src = torch.full((cache.spare,), -1, dtype=torch.int64, device=dev)  # host rows to copy
        self.down_from = down_offset(cache.layout)  # where a row's down projection starts (bytes)
        self.picks = picks  # [spare] int32 (a view of the layer's use counts): expert + 1, 0 none
        self.scratch = torch.zeros(cache.map.num_experts, dtype=torch.int32, device=dev)
        self.done = torch.cuda.Event() if dev.type == "cuda" else None
        self.pending = False  # this forward's copy started; the layer's kernel joins it
        self.down_only = False  # what the pending copy moved: the down projections alone


def down_offset(layout) -> int:
    """Bytes from a row's start to its first down-projection part (``w2``, then its scales; 0, the
    whole row, for a layout without one)."""
    return next((p.offset for p in layout.parts if p.name.startswith("w2")), 0)


def down_payload(layout) -> int:
    """Bytes a row's down-projection parts really hold (a down-only copy's payload; the whole
    row's for a layout without one)."""
    return sum(p.nbytes for p in layout.parts if p.offset >= down_offset(layout))


def start(pred: torch.Tensor, real: torch.Tensor, backend) -> None:
    """Pick and copy the layer ``backend``'s predicted host experts (``pred`` [T, k]) into its spare rows:
    the choice on the current stream, the copy on its host reads' stream after it (at once on a
    CPU); its MoE kernel then reads them there (``routes``)."""
    sp, fmt, stream = backend.spare, backend.reads.fmt, backend.reads.stream  # the format: rows, parts
    n = min(rows(fmt), len(sp.src))  # the switch's rows, at most the spare rows sized at start
    src, picks = sp.src[:n], sp.picks[:n]  # picks past n stay 0 (the use counts zero every step)
    select_into(pred, real, backend.cache.route, sp.eff, src, picks, sp.scratch, sp.first_row)
    sp.down_only = down_only(fmt)
    first = sp.down_from if sp.down_only else 0
    if stream is None:
        copy_rows(backend.store.block, backend.cache.block, sp.first_row, src, first)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # after the choice
        with torch.cuda.stream(stream):
            copy_rows(backend.store.block, backend.cache.block, sp.first_row, src, first)
            sp.done.record(stream)
    sp.pending = True


def routes(backend) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None]:
    """(the route of a host-read layer's gate/up kernel, its down kernel's, what the current
    stream runs between the two launches): through the spare rows when its lookahead started
    their copy in this forward, else the published route for both. A copy of whole experts is
    waited for before either kernel; one of the down projections (``DOWN_ONLY``) only before
    the down kernel, whose route alone goes through the spare rows."""
    sp = backend.spare
    if sp is None or not sp.pending:
        return backend.cache.route, backend.cache.route, None
    sp.pending = False

    def join() -> None:
        if sp.done is not None:
            torch.cuda.current_stream(backend.cache.device).wait_event(sp.done)

    if sp.down_only:
        return backend.cache.route, sp.eff, join
    join()
    return sp.eff, sp.eff, None


def select(
    pred: torch.Tensor, real: torch.Tensor, route: torch.Tensor, rows: int, first_row: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pred`` [T, k] predicted experts, ``real`` [T] bool, ``route`` [E] (slot, or -(host row +
    1)) -> (host rows to copy [rows] int64, -1 for none; the effective route [E]; the picks
    [rows] int32, expert + 1, 0 for none). The torch version (CPU, and the GPU kernel's oracle)."""
    t, k = pred.shape
    e = route.shape[0]
    host = (route[pred] < 0) & real[:, None]  # [T, k]
    rank = torch.arange(k, device=pred.device)
    tok = torch.arange(t, device=pred.device)
    prio = (k - rank)[None, :] * (t + 1) + (t - tok)[:, None]  # distinct, > 0: rank major
    prio = torch.where(host, prio, torch.zeros_like(prio))
    best = torch.zeros(e, dtype=prio.dtype, device=pred.device)
    best.scatter_reduce_(0, pred.reshape(-1), prio.reshape(-1), "amax")
    val, experts = best.topk(rows)
    valid = val > 0
    src = torch.where(valid, -route[experts] - 1, torch.full_like(experts, -1))
    spare = first_row + torch.arange(rows, device=pred.device)
    eff = route.clone()
    eff.scatter_(0, experts, torch.where(valid, spare, route[experts]))
    picks = torch.where(valid, experts + 1, torch.zeros_like(experts)).to(torch.int32)
    return src, eff, picks


def copy_rows(
    src_block: torch.Tensor, dst_block: torch.Tensor, first_row: int, src_rows: torch.Tensor, first: int = 0
) -> None:
    """``dst_block[first_row + i, first:] = src_block[src_rows[i], first:]`` where ``src_rows[i]``
    >= 0 (uint8 blocks of equal row size, ``first`` a multiple of 8; on CUDA the source is the
    pinned host store, read in place)."""
    assert first % 8 == 0, f"a copy starts on a whole word: {first} bytes"
    if dst_block.is_cuda:
        words = dst_block.shape[1] // 8
        _copy_rows_kernel[(COPY_PROGRAMS,)](
            src_block.view(torch.int64), dst_block.view(torch.int64), src_rows, first_row, words, first // 8,
            ROWS=len(src_rows), BLOCK=COPY_BLOCK, PROGRAMS=COPY_PROGRAMS,
        )  # fmt: skip
        return
    valid = src_rows >= 0
    picked = src_block[src_rows.clamp(min=0).to(src_block.device), first:].to(dst_block.device)
    spare = dst_block[first_row : first_row + len(src_rows), first:]
    spare.copy_(torch.where(valid[:, None], picked, spare))


def select_into(
    pred: torch.Tensor, real: torch.Tensor, route: torch.Tensor, eff: torch.Tensor, src: torch.Tensor,
    picks: torch.Tensor, scratch: torch.Tensor, first_row: int,
) -> None:  # fmt: skip
    """``select`` written into persistent buffers (``eff`` [E], ``src`` [rows] int64, ``picks``
    [rows] int32; ``scratch`` [E] int32 zeros, left zeroed): one kernel on a GPU."""
    if pred.is_cuda:
        t, k = pred.shape
        e = route.shape[0]
        block_tk, block_e = max(16, triton.next_power_of_2(t * k)), max(16, triton.next_power_of_2(e))
        _select_kernel[(1,)](
            pred.contiguous(), real.contiguous(), route, eff, src, picks, scratch, t, e, first_row,
            K=k, ROWS=len(src), BLOCK_TK=block_tk, BLOCK_E=block_e,
        )  # fmt: skip
        return
    s, r, p = select(pred, real, route, len(src), first_row)
    src.copy_(s)
    eff.copy_(r)
    picks.copy_(p)


if triton is not None:

    @triton.jit
    def _select_kernel(
        pred, real, route, eff, src, picks, scratch, T, E, first_row,
        K: tl.constexpr, ROWS: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        offs_e = tl.arange(0, BLOCK_E)
        in_e = offs_e < E
        tl.store(eff + offs_e, tl.load(route + offs_e, mask=in_e), mask=in_e)
        p = tl.arange(0, BLOCK_TK)
        in_p = p < T * K
        ids = tl.load(pred + p, mask=in_p, other=0)
        tok = p // K
        rank = p % K
        is_real = tl.load(real + tok, mask=in_p, other=0) != 0
        on_host = tl.load(route + ids, mask=in_p, other=0) < 0
        prio = (K - rank) * (T + 1) + (T - tok)
        prio = tl.where(in_p & is_real & on_host, prio, 0).to(tl.int32)
        tl.atomic_max(scratch + ids, prio, mask=in_p)
        tl.debug_barrier()
        best = tl.load(scratch + offs_e, mask=in_e, other=0, cache_modifier=".cg")
        tl.debug_barrier()  # every thread has read (E < threads replicates the layout)
        tl.store(scratch + offs_e, tl.zeros_like(best), mask=in_e)  # zeros for the next call
        for i in tl.static_range(ROWS):
            top = tl.max(best, 0)
            expert = tl.argmax(best, 0)
            valid = top > 0
            row = -tl.load(route + expert) - 1
            tl.store(src + i, tl.where(valid, row, -1).to(tl.int64))
            tl.store(picks + i, tl.where(valid, expert + 1, 0).to(tl.int32))
            tl.store(eff + expert, (first_row + i).to(tl.int64), mask=valid)
            best = tl.where(offs_e == expert, 0, best)

    @triton.jit
    def _copy_rows_kernel(
        src_block, dst_block, src_rows, first_row, WORDS, FIRST,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
    ):  # fmt: skip
        # words FIRST .. WORDS of each picked row
        pid = tl.program_id(0)
        chunks = tl.cdiv(WORDS - FIRST, BLOCK)
        for i in tl.static_range(ROWS):
            row = tl.load(src_rows + i)
            if row >= 0:
                src = src_block + row.to(tl.int64) * WORDS
                dst = dst_block + (first_row + i).to(tl.int64) * WORDS
                for c in range(pid, chunks, PROGRAMS):
                    offs = FIRST + c * BLOCK + tl.arange(0, BLOCK)
                    m = offs < WORDS
                    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
