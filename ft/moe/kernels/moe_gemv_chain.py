"""The MoE GEMV's two launches as one (``CHAIN``, off until timed): gate/up tiles and down tiles in
one grid, each down tile starting as soon as its pair's activations are stored.

``triton_moe_gemv`` runs a decode batch's routed experts as two launches, gate/up (a program per
(pair, BLOCK_N rows of I)) then down (a program per (token, BLOCK_N rows of H, pair)), and the
down launch waits for the whole gate/up launch to end before any of its programs loads a weight.
Both are bound by the latency of their loads (2026-12-05 census of the NVFP4 80B's batch-1 step on
an H200: gate/up 9.3 us a layer for ~16 MB, down 9.2 us for ~8 MB; ~2 us each at HBM's rate).

Here one launch has a program per tile of either kind, and each program takes its tile by ticket
(``chain[0]``, drawn first thing, before the PDL wait): the first tickets are gate/up tiles (the
shared expert's first), the rest down tiles, so every gate/up tile is taken by a running program
before any program takes a down tile, and a down tile waits only for programs that are running
and never wait themselves: no program can wait forever, whatever order or number of programs the
GPU runs at once.
A gate/up tile stores its rows of ``act`` and counts itself into its pair's ``ready`` counter (a
release); a down tile asks L2 for its weight rows (its expert is known from
the routing), waits until its pair's counter is full (polls with a back-off, then an acquire
fence), then runs as in the down launch. The program that finishes last sets the counters back to
zero, for the next call and the next replay of a graph. Consecutive launches take the two halves
of the counters in turn (``counters``): with PDL a launch's programs start while the kernel before
it ends, so one right after another chain could draw tickets from counters that launch is still
resetting; the chain before the one before has ended by then.

Each tile is the two launches' code (``moe_gemv_kernels.gate_up_tile``, ``moe_gemv_down.down_tile``) at the
launch's warps (gate/up's): gate/up's bits exactly, and down's sums over lanes in the order of
this warp count (a rounding of a term may differ from the two launches'; the pair order of the
sum over k is the same). Host reads (``HOST``) run here too; a down tile asks L2 for a slot's rows
only. With host staging (``STAGE``, ``host_stage.in_launch``) the first ``STAGE_TILES`` tickets copy
the host rows the batch reads into the staging block (every host row's 16 KB chunks in turn, a
share each, each first reader's chunks counted in ``copied``), and only a host pair's gate/up
tiles wait for them: the resident pairs compute while the link copies. Not here: a down kernel of
other rows (``host_prefetch``'s down-only copies), ``PREFETCH_DOWN`` (the down tiles here ask L2
for their own rows), more pairs than ``MAX_PAIRS``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.layers import l2_prefetch, triton_gemv
from ft.layers.l2_prefetch import prefetch_l2
from ft.layers.pdl import wait_for_previous
from ft.moe.backends.host_stage import STAGE_BLOCK, copy_chunk, first_reader
from ft.moe.kernels.moe_gemv_down import down_tile
from ft.moe.kernels.moe_gemv_kernels import gate_up_tile

# OFF until timed (tests/gpu/decode_variants.py ...:CHAIN); FT_MOE_GEMV_CHAIN=1 turns it on for a
# process and the ranks it spawns. Read at each call (a captured graph keeps its launches).
CHAIN = os.environ.get("FT_MOE_GEMV_CHAIN", "0") == "1"
# the down tiles ask L2 for their rows before they wait (FT_MOE_GEMV_CHAIN_PREFETCH=0: they do not)
PREFETCH = os.environ.get("FT_MOE_GEMV_CHAIN_PREFETCH", "1") != "0"
HALF = triton_gemv.RESERVED // 2  # one launch's counters: claim, done, a pair each (+ staging's)
MAX_PAIRS = HALF - 2
# the tiles that stage host rows (``launch``'s ``stage``), each copying its share of every host row's
# 16 KB chunks, in turn: host_prefetch's copies reach the link's rate from 16 programs
STAGE_TILES = 32

# a fence after relaxed loads that saw the release: what the pair's stores are ordered before
_ACQUIRE = tl.constexpr("fence.acq_rel.gpu; mov.u32 $0, 0;")
_BACK_OFF = tl.constexpr("nanosleep.u32 100; mov.u32 $0, 0;")  # between two polls


@triton.jit
def _wait_ready(ready, count, ASM: tl.constexpr):
    # until ``ready`` holds ``count``: relaxed polls (every thread its own), then each thread's
    # acquire fence (the interpreter, ASM off, runs programs one by one: the count is there already)
    while tl.load(ready, volatile=True) < count:
        if ASM:
            tl.inline_asm_elementwise(_BACK_OFF, "=r,r", [count], dtype=tl.int32, is_pure=False, pack=1)
    if ASM:
        tl.inline_asm_elementwise(_ACQUIRE, "=r,r", [count], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(rows, scales, at, nbytes, scales_at, scale_bytes: tl.constexpr, PF_CHUNKS: tl.constexpr):
    # a down tile's rows asked of L2: ``nbytes`` of ``rows`` from element ``at`` (contiguous: its
    # BLOCK_N rows of codes or weights) and, for NVFP4, ``scale_bytes`` of ``scales`` from ``scales_at``
    prefetch_l2((rows + at).to(tl.pointer_type(tl.uint8)), nbytes, PF_CHUNKS, False)
    if scale_bytes > 0:
        prefetch_l2((scales + scales_at).to(tl.pointer_type(tl.uint8)), scale_bytes, PF_CHUNKS, False)


@triton.jit
def _staged_row(rows, tok, slot, P, TOPK: tl.constexpr, BLOCK_P: tl.constexpr):
    # (the row pair (tok, slot) reads with host staging: its slot, or -(its first reader's staging
    # row + 1); that first reader; whether it is a host row) from the unstaged rows [T, k]
    # (``host_stage.plan``); the shared slot gets its token's last routed pair's (unread)
    mine, first = first_reader(rows, tok * TOPK + tl.minimum(slot, TOPK - 1), P, BLOCK_P)
    return tl.where(mine < 0, -first - 1, mine), first, (mine < 0) & (slot < TOPK)


@triton.jit
def _gate_up_pair(u, tokens, GU_BLOCKS, TOPK: tl.constexpr, SHARED: tl.constexpr):
    # gate/up tile u -> (pair, row block of I): the shared expert's tiles first, then the routed
    # pairs', token by token
    per_tok: tl.constexpr = TOPK + SHARED
    shared_tiles = tokens * GU_BLOCKS * SHARED
    is_shared = u < shared_tiles
    v = tl.where(is_shared, u, u - shared_tiles)
    r = v // GU_BLOCKS
    if TOPK > 0:
        p = tl.where(is_shared, r * per_tok + TOPK, (r // TOPK) * per_tok + r % TOPK)
    else:
        p = r * per_tok
    return p, v % GU_BLOCKS


@triton.jit
def _chain_kernel(
    x, xq, xf, b13, s13, g13, hb13, hs13, hg13, sb13, act, topk_ids, I, H,
    s_xt, s_qt, s_ft, u_be, u_bn, u_se, u_sn, u_ge, u_hn, s_at, s_it, s_ik, unfold,
    b2, s2, g2, hb2, hs2, hg2, sb2, logit, out, topk_w, ws, counters, chain,
    d_be, d_bn, d_se, d_sn, d_ge, d_hn, s_ot, s_wt, s_wk, s_lt, GU_BLOCKS, DOWN_BLOCKS,
    T, rows, stage_src, stage_dst, WORDS, S_CHUNKS, STAGE: tl.constexpr, S_TILES: tl.constexpr,
    S_BLOCK_P: tl.constexpr, S_BLOCK: tl.constexpr, PF_B: tl.constexpr, PF_S: tl.constexpr,
    PF_H: tl.constexpr,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP4: tl.constexpr, PLANES: tl.constexpr, INT_DOT: tl.constexpr,
    HOST: tl.constexpr, ASM: tl.constexpr, UP_EVEN_K: tl.constexpr, UP_BLOCK_N: tl.constexpr,
    UP_BLOCK_K: tl.constexpr, UP_LOOP_STAGES: tl.constexpr, UP_SHARED_BLOCK_K: tl.constexpr,
    DOWN_EVEN_K: tl.constexpr, DOWN_BLOCK_N: tl.constexpr, DOWN_BLOCK_K: tl.constexpr,
    DOWN_LOOP_STAGES: tl.constexpr, DOWN_PLANES: tl.constexpr, DOWN_SHARED_BLOCK_K: tl.constexpr,
    PAIRS_P: tl.constexpr, PF_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # chain: int32 [2 + pairs]: tickets drawn, programs done, then each pair's gate/up tiles stored
    t = tl.atomic_add(chain, 1, sem="relaxed")  # this program's tile (the counters outlive the kernel before)
    wait_for_previous(USE_PDL)
    per_tok: tl.constexpr = TOPK + SHARED
    r_tiles = 0  # the tiles before the gate/up ones: host staging's (STAGE)
    if STAGE:
        r_tiles = S_TILES
    pairs = (tl.num_programs(0) - r_tiles) // (GU_BLOCKS + DOWN_BLOCKS)  # GU_BLOCKS + DOWN_BLOCKS a pair
    gu_tiles = pairs * GU_BLOCKS
    ready = chain + 2
    copied = ready + pairs  # STAGE: each routed pair's chunks copied (a first reader's)
    if t < r_tiles:
        if STAGE:  # static: host staging's copies (``host_stage.copy_chunk``), a share each
            # every (pair, chunk), pair-major, the staging tiles taking them in turn: the first
            # host row lands first; only a first reader's chunks copy anything and count
            for item in range(t, T * TOPK * S_CHUNKS, r_tiles):
                i = item // S_CHUNKS
                mine, first = first_reader(rows, i, T * TOPK, S_BLOCK_P)
                if (mine < 0) & (first == i):
                    copy_chunk(mine, i, item % S_CHUNKS, stage_src, stage_dst, WORDS, S_BLOCK, 512)
                    tl.debug_barrier()  # every thread's copies before the release
                    tl.atomic_add(copied + i, 1, sem="release")
    elif t < r_tiles + gu_tiles:
        p, block = _gate_up_pair(t - r_tiles, pairs // per_tok, GU_BLOCKS, TOPK, SHARED)
        up_row = None  # (each branch's names its own: Triton merges a name both branches assign)
        if STAGE:  # static: a host row once its first reader's staging tiles are done
            up_row, first, host = _staged_row(rows, p // per_tok, p % per_tok, T * TOPK, TOPK, S_BLOCK_P)
            if host:
                _wait_ready(copied + first, S_CHUNKS, ASM)
        gate_up_tile(
            p, block, x, xq, xf, b13, s13, g13, hb13, hs13, hg13, sb13, act, topk_ids, I, H,
            s_xt, s_qt, s_ft, u_be, u_bn, u_se, u_sn, u_ge, u_hn, s_at, s_it, s_ik, unfold, TOPK, SHARED, FP4,
            UP_EVEN_K, UP_BLOCK_N, UP_BLOCK_K, UP_LOOP_STAGES, HOST, PLANES, UP_SHARED_BLOCK_K, INT_DOT, ASM,
            up_row,
        )  # fmt: skip
        tl.debug_barrier()  # every thread's act stores before the release (one thread's atomic)
        tl.atomic_add(ready + p, 1, sem="release")
    else:
        d = t - r_tiles - gu_tiles  # (token, row block, pair slot), the slot fastest
        slot = d % per_tok
        block = (d // per_tok) % DOWN_BLOCKS
        tok = d // (per_tok * DOWN_BLOCKS)
        # the tile's rows asked of L2 before its wait (``_prefetch_rows``)
        if PF_CHUNKS > 0 and PF_H > 0:  # noqa: SIM102 (static)
            if slot == TOPK:
                _prefetch_rows(sb2, sb2, DOWN_BLOCK_N * block * d_hn, PF_H, 0, 0, PF_CHUNKS)
        down_row = None
        if STAGE:  # static: its gate/up tiles waited for the staging (``ready`` below orders it)
            down_row = _staged_row(rows, tok, slot, T * TOPK, TOPK, S_BLOCK_P)[0]
        if PF_CHUNKS > 0:  # noqa: SIM102 (static)
            if STAGE:
                e = tl.where(slot < TOPK, down_row, -1)
            else:
                e = tl.load(topk_ids + tok * s_it + slot * s_ik, mask=slot < TOPK, other=-1).to(tl.int64)
            if e >= 0:  # a routed expert in a slot (rows of the host store, e < 0, are left alone)
                row = DOWN_BLOCK_N * block
                _prefetch_rows(b2, s2, e * d_be + row * d_bn, PF_B, e * d_se + row * d_sn, PF_S, PF_CHUNKS)
        _wait_ready(ready + tok * per_tok + slot, GU_BLOCKS, ASM)
        down_tile(
            tok, block, slot, DOWN_BLOCKS, act, b2, s2, g2, hb2, hs2, hg2, sb2, logit, out, topk_w, topk_ids,
            ws, counters, H, I, s_at, d_be, d_bn, d_se, d_sn, d_ge, d_hn, s_ot, s_wt, s_wk, s_it, s_ik, s_lt,
            unfold, TOPK, SHARED, FP4, DOWN_EVEN_K, DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_LOOP_STAGES, HOST,
            DOWN_PLANES, DOWN_SHARED_BLOCK_K, down_row,
        )  # fmt: skip
    tl.debug_barrier()  # this program's stores and reads before its count
    done = tl.atomic_add(chain + 1, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:  # every program has finished: the counters back to zero
        c = tl.arange(0, PAIRS_P)
        tl.store(ready + c, tl.zeros([PAIRS_P], tl.int32), mask=c < pairs)
        if STAGE:
            tl.store(copied + c, tl.zeros([PAIRS_P], tl.int32), mask=c < T * TOPK)  # T * TOPK < pairs
        tl.store(chain + 1, 0)
        tl.store(chain, 0)


def stages(pairs: int, routed: int) -> bool:
    """Whether a launch of ``pairs`` pairs, ``routed`` of them an expert's, may stage its host rows
    (``launch``'s ``stage``): the switch on, and room for its counters."""
    return CHAIN and _staging_fits(pairs, routed)


def _staging_fits(pairs: int, routed: int) -> bool:
    # a launch's counters in its half: claim, done, a pair each, a routed pair's copies each
    return 2 + pairs + routed <= HALF


def _stage_args(stage: tuple | None, ids: torch.Tensor, pairs: int) -> dict:
    """The staging tiles' arguments (``launch``'s ``stage``), or placeholders (unread) without."""
    if stage is None:
        return dict(rows=ids, src=ids, dst=ids, WORDS=1, S_CHUNKS=1, S_BLOCK_P=16, S_TILES=0)
    rows, store_block, block = stage
    rows = rows.contiguous().view(-1)
    assert store_block.shape[1] == block.shape[1] and block.shape[0] >= len(rows), (
        "staging rows as the store's"
    )
    assert _staging_fits(pairs, len(rows)), f"{pairs} pairs, {len(rows)} routed: too many to stage"
    words = store_block.shape[1] // 8
    return dict(
        rows=rows, src=store_block.view(torch.int64), dst=block.view(torch.int64), WORDS=words,
        S_CHUNKS=triton.cdiv(words, STAGE_BLOCK), S_BLOCK_P=max(16, triton.next_power_of_2(len(rows))),
        S_TILES=STAGE_TILES,
    )  # fmt: skip


_turn = [0]  # which half of the counters the next launch takes


def counters(device: torch.device) -> torch.Tensor:
    """A launch's counters: a half of the device's ``triton_gemv.RESERVED`` tickets (used by nothing
    else), the other half from the launch before (a graph keeps the half it captured)."""
    _turn[0] ^= 1
    start = triton_gemv.BLOCK_COUNTERS + _turn[0] * HALF
    return triton_gemv.tickets(device)[start : start + HALF]


def takes(down, prefetch_down: bool, pairs: int) -> bool:
    """Whether a call runs as one launch: the switch on, both kernels reading the same rows (slots,
    or with host reads the host store's or host staging's)."""
    return CHAIN and down is None and not prefetch_down and pairs <= MAX_PAIRS


def launch(
    gate_up: dict, down: dict, tiles: dict, pairs: int, ASM: bool, stage: tuple | None = None, **launch_args,
) -> None:  # fmt: skip
    """One launch for the two: ``gate_up`` and ``down``, the arguments ``triton_moe_gemv`` passes
    each kernel, by name; ``tiles``: each kernel's tiles (``UP_``, ``DOWN_`` and the name) and the
    bank's flags; ``ASM``: inline PTX (off under the interpreter); ``stage``: host staging's tiles
    first, (the rows [T, k] unstaged, the host store's uint8 block, the staging block;
    ``host_stage.stage``'s), the host operand then the staging rows; ``launch_args``: warps,
    stages, PDL (gate/up's)."""
    g, d = gate_up, down
    gu_blocks = triton.cdiv(g["N"], tiles["UP_BLOCK_N"])
    down_blocks = triton.cdiv(d["N"], tiles["DOWN_BLOCK_N"])
    assert pairs <= MAX_PAIRS, f"{pairs} pairs: the chain counts {MAX_PAIRS} at most"
    bn = tiles["DOWN_BLOCK_N"]
    # what a down tile asks L2 for (``_prefetch_rows``): its rows' bytes (codes or weights; scales of
    # NVFP4; the shared expert's), where each starts and ends on 16 bytes (the bulk prefetch's
    # unit), every row block is whole (none reaches past its expert), on sm_90 or later, and the
    # interpreter is not running (``ASM``)
    rows = [("s_bn", "s_be", d["b"])] + [("s_sn", "s_se", d["b_scale"])] * tiles["FP4"]
    rows += [("s_hn", "s_hn", d["shared_b"])] * tiles["SHARED"]
    pf = {row: bn * d[row] * t.element_size() for row, _, t in rows}
    whole = d["N"] % bn == 0 and all(
        pf[row] % 16 == 0 and t.data_ptr() % 16 == 0 and d[start] * t.element_size() % 16 == 0
        for row, start, t in rows
    )
    takes = PREFETCH and whole and ASM and l2_prefetch.takes(d["b"])
    pf_chunks = 32 * launch_args["num_warps"] if takes else 0
    s = _stage_args(stage, d["topk_ids"], pairs)
    _chain_kernel[(s["S_TILES"] + pairs * (gu_blocks + down_blocks),)](
        g["x"], g["xq"], g["xf"], g["b"], g["b_scale"], g["b_global"], g["host_b"], g["host_scale"],
        g["host_global"], g["shared_b"], g["act"],
        g["topk_ids"], g["N"], g["K"], g["s_xt"], g["s_qt"], g["s_ft"], g["s_be"], g["s_bn"], g["s_se"],
        g["s_sn"], g["s_ge"], g["s_hn"], g["s_at"], g["s_it"], g["s_ik"], g["unfold"],
        d["b"], d["b_scale"], d["b_global"], d["host_b"], d["host_scale"], d["host_global"], d["shared_b"],
        d["shared_logit"], d["out"], d["topk_w"], d["ws"],
        d["counters"], counters(d["out"].device), d["s_be"], d["s_bn"], d["s_se"], d["s_sn"], d["s_ge"],
        d["s_hn"], d["s_ot"], d["s_wt"], d["s_wk"], d["s_lt"], gu_blocks, down_blocks,
        g["x"].shape[0], s["rows"], s["src"], s["dst"], s["WORDS"], s["S_CHUNKS"],
        STAGE=stage is not None, S_TILES=s["S_TILES"], S_BLOCK_P=s["S_BLOCK_P"], S_BLOCK=STAGE_BLOCK,
        PF_B=pf["s_bn"], PF_S=pf.get("s_sn", 0), PF_H=pf.get("s_hn", 0),
        PAIRS_P=triton.next_power_of_2(pairs), PF_CHUNKS=pf_chunks, ASM=ASM, **tiles, **launch_args,
    )  # fmt: skip
