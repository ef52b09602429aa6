"""Fused MoE at decode sizes (a few tokens) as GEMVs, for bf16 and NVFP4 (W4A16) expert banks: no
token->expert sort, no 16-row MMA tiles, two launches.

Same contract as ``triton_moe.fused_moe_triton`` and ``triton_w4a16.fused_moe_w4a16``, which
dispatch here up to their ``GEMV_MAX_TOKENS``. With p = (t, j) a (token, top-k slot) pair and
e = ids[t, j] its expert (for NVFP4, ``W = e2m1(code) · scale`` decoded in registers, from 32-bit
words of eight codes by ``fp4_words.code`` or byte-wise by ``fp4_decode.decode``, and ``g`` the
per-row globals; for bf16, g = 1):

    act[p, n] = silu(g_gate[e, n] · x[t]·W_gate[e, n]) · (g_up[e, n] · x[t]·W_up[e, n])   # [T*k, I]
    out[t, n] = sum_j weights[t, j] · g_down[e, n] · act[(t, j)]·W_down[e, n]              # [T, H]

The first launch runs one program per (pair, BLOCK_N rows of I); the second one program per
(token, BLOCK_N rows of H, pair), each storing its pair's rounded term, the last of a row block
summing them in pair order, so the sum over k needs no third kernel. Dot products are fp32
multiply-accumulates of BLOCK_K-wide chunks kept per lane and reduced once per expert with
``tl.sum`` (no ``tl.dot``).
As in the MMA paths, ``act`` is rounded to bf16 and so is each pair's weighted term, and ``out``
sums a token's k terms in fp32 and rounds once: a batch computed a pair at a time (the offload backend's
streaming, k = 1 per call) and summed in fp32 gives the same bits as one call, exactly for
k = 2 and up to the fp32 order of the terms beyond. Not here: the kernels' code (``moe_gemv_kernels``,
``moe_gemv_down``, ``fp4_words``), the operands as they take them (``moe_gemv_operands``),
large T (an expert hit by many tokens is read once per token here, once per tile there), fp16
activations with NVFP4, W4A4.
"""

from __future__ import annotations

import os

import torch
import triton

from ft.layers import triton_gemv
from ft.layers.pdl import pdl_args
from ft.moe.kernels import int_dot
from ft.moe.kernels.fp4_decode import UNFOLD
from ft.moe.kernels.moe_gemv_down import _down_pair_kernel
from ft.moe.kernels.moe_gemv_kernels import _gate_up_kernel
from ft.moe.kernels.moe_gemv_operands import bank, host_operands, named_strides, word_aligned
from ft.moe.kernels.triton_moe import check_operands as check_bf16_operands
from ft.moe.kernels.triton_w4a16 import INTERPRETER
from ft.moe.kernels.w4a16_operands import check_operands
from ft.quant.nvfp4 import NVFP4Tensor

# (BLOCK_N weight rows per program, MAX_BLOCK_K input elements per step, NUM_WARPS, STAGES of
# loads in flight) per bank format; module constants so tests/gpu/config_sweep.py can vary them.
# H200, 2026-11-30, Qwen3-Next's 512 x (2 x 512) x 2048 banks, top-10, per call over 8 routings:
# bf16 28.1 / 40.2 / 70.0 us at T = 1 / 2 / 4 (the MMA path 30.7 / 48.5 / 84.7); NVFP4 31.4 us at
# T=1 (MMA path 46.4). T=1, k=10 with BLOCK_N 8 is 10 x 64 gate/up and 256 down programs.
BF16 = (8, 512, 4, 4)
NVFP4 = (8, 512, 8, 4)
# the down kernel's, both formats (bytes; NVFP4 words: ``NVFP4_DOWN_PLANES``): the best of
# tests/gpu/config_sweep.py moe_gemv_kernels on an H200 (2026-12-01), small 2-warp programs,
# 2,816 of them at T=1
PAIR_DOWN = (8, 512, 2, 1)


def _tiles_from_env(name: str, default):
    # FT_MOE_GEMV_<NAME>=BN,BK,WARPS,STAGES sets a tile for a process (what a sweep's best is
    # benchmarked with before it is written here)
    value = os.environ.get(f"FT_MOE_GEMV_{name}")
    return tuple(int(v) for v in value.split(",")) if value else default


BF16, NVFP4 = _tiles_from_env("BF16", BF16), _tiles_from_env("NVFP4", NVFP4)
# The bf16 gate/up launch that reads rows from the host store (``host`` given: the offload
# backend's host reads) at tiles of its own (``HOST_TILES``, on; FT_MOE_GEMV_HOST_TILES=0 turns it off
# for a process and the ranks it spawns, FT_MOE_GEMV_BF16_HOST=BN,BK,WARPS,STAGES sets them). In
# the offloaded 16-layer cut's decode profile (H200, 2026-12-02, docs/benchmarks.md) gate/up took
# 238 us a layer against 180 us of link time for its host rows, down 104 against 90. At BF16's four
# loop stages the pipeliner copies the host rows through shared memory (52 KB a program compiled
# for sm_90), where the down kernel's single stage loads them straight; one stage at BF16's other
# tiles is the same arithmetic, the same bits. (Either way a program takes ~128 registers, four an
# SM: a batch-1 step's ~700 gate/up programs take more than one wave, and the host rows of those
# in the second start late. Tiles that fit one wave, e.g. (8, 256, 4, 2) at 78 registers, change
# the sums' order, so they would be BF16's own: offloaded decode keeps the resident bits.) Timed a
# process each on the full bf16 80B at batch 1 (H200, 2026-12-03 22:00 UTC, the same 77.2% hit
# rate and bytes): 49.3 -> 53.9 tok/s, 79% -> 83% of its PCIe floor.
HOST_TILES = os.environ.get("FT_MOE_GEMV_HOST_TILES", "1") == "1"
BF16_HOST = _tiles_from_env("BF16_HOST", (BF16[0], BF16[1], BF16[2], 1))
# The NVFP4 launches that read rows from the host store keep their tiles (so their bits, whatever
# is cached) but may keep more loads in flight: (gate/up, down) loop stages in place of the tiles'
# (FT_MOE_GEMV_NVFP4_HOST_STAGES=G,D; unset: the tiles' own). Loads from host memory wait out a
# PCIe round trip, where the integer-product tiles' single stage was chosen against HBM's: in
# tests/gpu/host_read_timings.py an NVFP4 call read its host experts at 50-60 GB/s on 2026-12-02
# (8 x 512 tiles, 4 stages) and at ~33 GB/s since (the integer products' 4 x 512, 1 stage), and
# the full 80B under 48 GiB decodes at 55% of its PCIe floor (docs/benchmarks.md, 2026-12-03).
# Swept on an H200 the same day (host_read_timings.py nvfp4): 2,2 / 3,2 / 4,2 / 3,3 read ten host
# experts in 476-492 us against 514 at the tiles' own stages, within the rows' spread (gate/up
# 40-46 GB/s, down 18-28 either way): unset. Loop stages are not what holds the down kernel back.
NVFP4_HOST_STAGES = _tiles_from_env("NVFP4_HOST_STAGES", None)
PAIR_DOWN = _tiles_from_env("PAIR_DOWN", PAIR_DOWN)
# A block's (bf16) shared expert as one more pair of each token in these two launches, beside a
# bf16 or NVFP4 bank, instead of its own four (gate/up GEMV, SiLU, down GEMV, gated add: ~12 us of
# a Qwen3-Next decode layer in the census, where the shared expert's I equals the routed one's).
# Its term is then rounded like a routed pair's and summed with them in fp32, where the unfused
# block rounds the shared output and adds it to the rounded routed sum: a bf16-ulp difference.
# On (the block, ``ft.moe.block.SparseMoeBlock``, asks; the resident and offload backends take it,
# the hybrid and CPU ones keep the four launches): 24-layer Qwen3-Next batch-1 decode 411.8 ->
# 436.3 tok/s on an H200 (docs/benchmarks.md, 2026-11-30 06:00 UTC); bf16 decode log-probs as
# close to fp32 as without (tests/gpu/test_engine_cuda.py). FT_SHARED_AS_PAIR=0 turns it off for a
# process and the ranks it spawns.
SHARED_AS_PAIR = os.environ.get("FT_SHARED_AS_PAIR", "1") != "0"
# The kernels' loops as ``tl.range(..., num_stages=STAGES)``: Triton pipelines only the loads that
# feed a ``tl.dot`` from the launch's num_stages, and these kernels have none (compiled for sm_90
# they take 128 bytes of shared memory: no load buffered ahead), so each step's loads wait for
# the last one's; a loop's own num_stages asks the pipeliner to run most loads STAGES-1 steps
# ahead. Same arithmetic, same bits. On since 2026-12-01 (FT_MOE_GEMV_PIPELINE=0 turns it off):
# batch-1 decode of the 24-layer Qwen3-Next on an H200 456 -> 464 tok/s in bf16, 407 -> 450 with
# NVFP4 experts (docs/benchmarks.md).
PIPELINE = os.environ.get("FT_MOE_GEMV_PIPELINE", "1") != "0"
# The down kernel runs a program per (token, BLOCK_N rows of H, pair): at T=1 with k=10 and a
# shared pair, 2,816 programs that each load one expert's rows and reduce once (a program per
# (token, rows) walking the token's pairs chained eleven loads and reductions: removed 2026-12-04,
# slower in every timing since 2026-12-01, docs/benchmarks.md). Each program stores its rounded
# term into a workspace [T, pairs, H] and draws a ticket from its (token, rows) counter
# (``triton_gemv.tickets``); the last of the pairs sums the terms in pair order, the shared term
# last, so the sum does not depend on which program finishes last.
#
# The gate/up kernel's NVFP4 codes read as 32-bit words of eight and decoded in place
# (``fp4_words.fp4_words``, ``code``): the code's magnitude bits placed into an fp32 (no
# fp16 step), the inputs paired with each word's eight codes by reading them as bf16 pairs (no reshape of the
# codes), a block's sixteen products summed first and its scale multiplied in once. An H200's
# profile of the byte-wise decode (ncu, 2026-12-01, docs/benchmarks.md) has the gate/up kernel busy
# issuing (60% of the SMs' throughput, 10% of DRAM's), its loop 470 SASS instructions for 32
# weights a thread, 153 of them byte permutes. The inputs are multiplied by 2^64 (exact) so that
# every product e2m1 · 2^-126 · x · 2^64 is a normal fp32 (an input below 2^-63 in magnitude gives
# a subnormal product, a few bits short: against sums of order 1e-2, nothing; one of 2^64 or more
# overflows to inf, and a zero code's product is then NaN where the byte-wise sum stays finite);
# the block's sum times scale · 2^40 is the byte-wise value · 2^-22. Each code is three
# instructions (``fp4_words.code``) and one multiply-add. The weights are the same values; the per-lane
# partial sums run over other lanes, so their fp32 order, and a rounding, can differ (greedy
# tokens of a random-weight 80B diverge: 2% agree). Under ncu gate/up went 23.8 -> 17.2 us; the
# 80B's batch-1 decode with NVFP4 experts 248.5 -> 273.5 tok/s (H200, 2026-12-01). (The scale
# multiplied per code instead, 20.5 us: removed 2026-12-04.) On; FT_MOE_GEMV_FP4_PLANES=0 reads
# bytes, as does any code tensor not 4-byte aligned (``moe_gemv_operands.word_aligned``).
FP4_PLANES = os.environ.get("FT_MOE_GEMV_FP4_PLANES", "1") != "0"
# its own gate/up tiles: the sweep's best at T=1 (one loop stage: 4,096 codes a program, four
# steps of 512)
NVFP4_PLANES = _tiles_from_env("NVFP4_PLANES", (4, 512, 4, 1))
# The down kernel reads words too (with gate/up's words), at tiles of its own.
# tests/gpu/config_sweep.py moe_gemv_planes on an H200 (2026-12-01, 94b9f7a), gate/up + down a
# call: T=1 23.0 us byte-wise -> 18.9, T=2 37.5 -> 28.0; the 80B's batch-1 decode with NVFP4
# experts 269.3 -> 283.8 tok/s (docs/benchmarks.md). On (FT_MOE_GEMV_FP4_DOWN_PLANES=0: bytes).
FP4_DOWN_PLANES = os.environ.get("FT_MOE_GEMV_FP4_DOWN_PLANES", "1") != "0"
NVFP4_DOWN_PLANES = _tiles_from_env("NVFP4_DOWN_PLANES", (8, 256, 2, 1))
# Beside an NVFP4 bank the bf16 shared pair is a branch of its own in both kernels, and its per-lane
# partial sums over BLOCK_K (fp32 [BLOCK_N, BLOCK_K], e.g. 32 registers a thread at (4, 512, 4 warps))
# set the kernel's registers for every program: compiled for sm_90, gate/up at its tiles takes 72
# registers with the shared branch and 39 without (an SM then holds 7 of its 4-warp programs, and
# the 1,408 of a Qwen3-Next batch-1 step, 11 pairs x 128, run in 1.5 waves), the down kernel by pair
# 72 (at its own BLOCK_K of 256). Stepping the shared rows by fewer inputs (NVFP4_SHARED_BK for
# gate/up, NVFP4_SHARED_BK_DOWN for down; 0: BLOCK_K, else a power of two from 16, at most BLOCK_K)
# shrinks the branch (gate/up 40 registers at 64 or 128; down 48 at 128, 32 at 64) but walks the
# shared rows in more, shorter steps. H200, tests/gpu/config_sweep.py moe_gemv_shared (2026-12-02,
# gate/up + down with the shared pair a call over 8 routings, two passes): at the shipped tiles T=1
# 21.1 us at (0, 0), 20.3 at (0, 128), 20.4 at (64, 0), 20.6 at (128, 128); T=2 35.4 -> 33.5 at
# (0, 128); the 80B's batch-1 decode 303.1 tok/s at (0, 128) against 292.0-298.2 for three rows of
# the defaults then (docs/benchmarks.md). The shared term's fp32 sums run in another order (a
# rounding of it can differ). Again on an H200 (2026-12-02, config_sweep.py moe_gemv_int, two
# passes) gate/up at 64 against 0: T=1 20.4 -> 19.9 us, T=2 34.6 -> 31.1. Defaults: 64 in gate/up,
# 128 in down; FT_MOE_GEMV_NVFP4_SHARED_BK(_DOWN)=N.
NVFP4_SHARED_BK = int(os.environ.get("FT_MOE_GEMV_NVFP4_SHARED_BK", "64"))
NVFP4_SHARED_BK_DOWN = int(os.environ.get("FT_MOE_GEMV_NVFP4_SHARED_BK_DOWN", "128"))
# The gate/up kernel's NVFP4 products as integer dot products (with the words): int16 input
# blocks times int8 code magnitudes by ``dp2a``, a block's sum an exact integer (``int_dot``: the
# arithmetic, what an input keeps, where the blocks come from). Compiled for sm_90 at (4, 512, 4,
# 1) the loop is 125 SASS instructions for 32 weights a thread (the words: 224), no shared-memory
# exchange in it, 40 registers without the shared branch. H200 (2026-12-02, docs/benchmarks.md):
# tests/gpu/config_sweep.py moe_gemv_int (gate/up + down with the shared pair and the quantising
# launch, shared step 64) T=1 19.9 -> 19.0 us, T=2 31.1 -> 29.5; under ncu gate/up alone 17.6 ->
# 15.9 us, still waiting on its loads (long-scoreboard stalls about half of a warp's cycles), the
# quantising launch 2.9 us alone. The 80B's batch-1 decode with the blocks from the router, rows
# alternating in one process: off 294.8 / 295.9, on 303.5 / 303.9 / 302.4 tok/s. On
# (FT_MOE_GEMV_FP4_INT_DOT=0 turns it off for a process and the ranks it spawns): with it on,
# run_gpu_tests.sh kernels gave 558 passed and the offload NVFP4 tests 19 passed (2026-12-02 05:10).
FP4_INT_DOT = os.environ.get("FT_MOE_GEMV_FP4_INT_DOT", "1") != "0"
NVFP4_INT = _tiles_from_env("NVFP4_INT", (4, 512, 4, 1))  # its gate/up tiles
# The integer gate/up loop unrolled GATE_UP_UNROLL times (Triton's loop_unroll_factor; 1: not).
# At Qwen3-Next's H a row is four 512-wide steps, each waiting for its own loads at one stage (more
# stages lost, 2026-12-03); unrolled by two, ptxas issues the second step's loads before the first
# step's products (compiled for sm_90: 40 registers, as at 1; 48 at 4). Same arithmetic, same bits.
# H100 (2026-12-05, docs/benchmarks.md): config_sweep.py moe_gemv_unroll, gate/up + down with the
# shared pair a call, T=1 19.7 -> 17.7 us, T=2 31.8 -> 28.8 (at 4: 19.4, 29.8); the NVFP4 80B's
# batch-1 decode 307.0 / 305.8 -> 309.1 / 308.8 tok/s (at 4: 300.8). On at 2;
# FT_MOE_GEMV_GATE_UP_UNROLL=1 turns it off for a process.
GATE_UP_UNROLL = int(os.environ.get("FT_MOE_GEMV_GATE_UP_UNROLL", "2"))


def launch_moe_gemv(
    x: torch.Tensor,
    w13,
    w2,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: tuple | None = None,
    host: tuple | None = None,
    down: tuple | None = None,
) -> torch.Tensor:
    """Checks and launches without the device check (the Triton interpreter runs it on CPU
    tensors): x [T, H]; w13 [E, 2I, H] and w2 [E, H, I] bf16 tensors or NVFP4 stacks;
    weights/ids [T, k] -> [T, H]. ``shared``: (gate_up [2I, H], down [H, I], logit [T, 1]) of a
    shared expert in the activations' dtype with the routed experts' I (beside bf16 or NVFP4
    routed experts), computed as one more pair of each token, weighted by sigmoid(logit), its
    term added after the routed ones (``SHARED_AS_PAIR``). ``host``: (w13, w2) of the offload
    backend's host store, laid out as ``w13``/``w2`` (its cache slots); an id e < 0 then reads
    host row -e - 1 instead of a slot, over PCIe, inside the same launch (``host_reads.py``), or
    rows that host staging copied to the device (``host_stage.py``: device tensors).
    ``down``: (ids [T, k] of the down kernel's rows, a callable run between the two launches or
    None), when the down projections are read from other rows than gate/up (``host_prefetch``'s
    down-only copies, joined by the callable); the same bytes give the same result."""
    t, h = x.shape
    check = check_operands if isinstance(w13, NVFP4Tensor) else check_bf16_operands
    _, inter, topk = check(x, w13, w2, weights, ids)
    down_ids, before_down = down if down is not None else (ids, None)
    assert down_ids.shape == ids.shape and down_ids.dtype == ids.dtype, (
        f"down ids {down_ids.dtype} {tuple(down_ids.shape)}, gate/up ids {ids.dtype} {tuple(ids.shape)}"
    )
    assert not ids.is_floating_point() and weights.is_floating_point(), (
        f"ids must be integers and weights floats, got {ids.dtype} and {weights.dtype}"
    )
    blocks = int_dot.take_blocks(x)  # the router's int16 blocks of x, if it made them
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    b13, s13, g13, fp4 = bank(w13)
    b2, s2, g2, _ = bank(w2)
    for step in (NVFP4_SHARED_BK, NVFP4_SHARED_BK_DOWN):
        assert step == 0 or (step >= 16 and step & (step - 1) == 0), f"shared step {step}: 0 or a power of 2"
    h13 = (b13, s13, g13) if host is None else host_operands(w13, host[0])  # unread without host
    h2 = (b2, s2, g2) if host is None else host_operands(w2, host[1])
    # host rows read over PCIe take their own tiles and stages (the same bits); rows on the device
    # (host staging's block, ``host_stage.py``) the resident ones
    over_pcie = host is not None and h13[0].device.type == "cpu"
    sb13, sb2, logit = (x, x, weights) if shared is None else shared  # unread without a shared expert
    if shared is not None:
        assert sb13.shape == (2 * inter, h) and sb2.shape == (h, inter), (
            f"shared expert {tuple(sb13.shape)}, {tuple(sb2.shape)} does not fit the bank's I={inter}, H={h}"
        )
        assert sb13.dtype == sb2.dtype == x.dtype, f"shared expert {sb13.dtype}, activations {x.dtype}"
        assert sb13.stride(1) == sb2.stride(1) == 1 and logit.numel() == t, "rows contiguous, a logit a token"
    pairs = topk + (shared is not None)
    act = torch.empty(t * pairs, inter, dtype=x.dtype, device=x.device)  # [T*(k+shared), I]
    # the words read x as bf16 pairs: 4-byte aligned rows (any view the engine passes; else bytes)
    planes = (
        fp4 and FP4_PLANES and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0 and word_aligned(b13, *h13[:1])
    )
    int_products = planes and FP4_INT_DOT and word_aligned(b13, *h13[:1], size=8)  # a block's codes: 8 bytes
    block_n, max_block_k, num_warps, stages = (
        (NVFP4_INT if int_products else NVFP4_PLANES if planes else NVFP4)
        if fp4
        else BF16_HOST
        if over_pcie and HOST_TILES
        else BF16
    )
    host_stages = NVFP4_HOST_STAGES if fp4 and over_pcie else None  # same tiles, same bits
    if host_stages is not None:
        stages = host_stages[0]
    bk_up = min(max_block_k, max(32, triton.next_power_of_2(h)))
    flags = dict(TOPK=topk, SHARED=int(shared is not None), FP4=fp4, HOST=host is not None)
    # unread without the integer products
    xq, xf = (blocks or int_dot.quantize_blocks(x)) if int_products else (x, x)
    gate_up = dict(
        x=x, xq=xq, xf=xf, b=b13, b_scale=s13, b_global=g13, host_b=h13[0], host_scale=h13[1],
        host_global=h13[2], shared_b=sb13, act=act, topk_ids=ids, N=inter, K=h, s_xt=x.stride(0),
        s_qt=xq.stride(0), s_ft=xf.stride(0), **named_strides(b13, s13, g13), s_hn=sb13.stride(0),
        s_at=act.stride(0), s_it=ids.stride(0), s_ik=ids.stride(1), unfold=UNFOLD,
    )  # fmt: skip
    up_tiles = dict(BLOCK_N=block_n, EVEN_K=h % bk_up == 0, BLOCK_K=bk_up,
                    LOOP_STAGES=stages if PIPELINE else 1,
                    SHARED_BLOCK_K=min(NVFP4_SHARED_BK, bk_up) if fp4 else 0)  # fmt: skip
    up_launch = dict(num_warps=num_warps, num_stages=stages, **pdl_args(x))
    # words in the down kernel only beside words in gate/up (``FP4_PLANES=0``: bytes in both), codes
    # 4-byte aligned
    down_planes = planes and FP4_DOWN_PLANES and word_aligned(b2, *h2[:1])
    down_n, down_k, down_warps, down_stages = NVFP4_DOWN_PLANES if down_planes else PAIR_DOWN
    if host_stages is not None:
        down_stages = host_stages[1]
    bk_down = min(down_k, max(32, triton.next_power_of_2(inter)))
    blocks = triton.cdiv(h, down_n)
    assert t * blocks <= triton_gemv.COUNTERS, f"T={t} x {blocks} row blocks: more than the counters"
    ws = torch.empty(t, pairs, h, dtype=torch.float32, device=x.device)  # the pairs' rounded terms
    down_args = dict(
        act=act, b=b2, b_scale=s2, b_global=g2, host_b=h2[0], host_scale=h2[1], host_global=h2[2],
        shared_b=sb2, shared_logit=logit, out=out, topk_w=weights, topk_ids=down_ids, ws=ws,
        counters=triton_gemv.tickets(x.device), N=h, K=inter, s_at=act.stride(0), **named_strides(b2, s2, g2),
        s_hn=sb2.stride(0), s_ot=out.stride(0), s_wt=weights.stride(0), s_wk=weights.stride(1),
        s_it=down_ids.stride(0), s_ik=down_ids.stride(1), s_lt=logit.stride(0), unfold=UNFOLD,
    )  # fmt: skip
    down_tiles = dict(BLOCK_N=down_n, EVEN_K=inter % bk_down == 0, BLOCK_K=bk_down, PLANES=down_planes,
                      LOOP_STAGES=down_stages if PIPELINE else 1,
                      SHARED_BLOCK_K=min(NVFP4_SHARED_BK_DOWN, bk_down) if fp4 else 0)  # fmt: skip
    _gate_up_kernel[(t * pairs, triton.cdiv(inter, block_n))](
        **gate_up, **flags, **up_tiles, PLANES=planes, INT_DOT=int_products, ASM=not INTERPRETER,
        UNROLL=GATE_UP_UNROLL if int_products and not over_pcie else 1, **up_launch,  # host rows: untimed
    )  # fmt: skip
    if before_down is not None:
        before_down()
    _down_pair_kernel[(t, blocks, pairs)](
        **down_args, **flags, **down_tiles, num_warps=down_warps, num_stages=down_stages, **pdl_args(act),
    )  # fmt: skip
    return out


def fused_moe_gemv(
    x: torch.Tensor,
    w13,
    w2,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: tuple | None = None,
    host: tuple | None = None,
    down: tuple | None = None,
) -> torch.Tensor:
    """``launch_moe_gemv`` on CUDA tensors (``host``: pinned host tensors the GPU can address, or
    tensors on its device: host staging's block). Graph-capturable: the grid comes from shapes,
    the experts are read on the device."""
    w = w13.weight if isinstance(w13, NVFP4Tensor) else w13
    assert x.is_cuda and w.device == x.device == ids.device, "fused_moe_gemv needs CUDA tensors on one device"
    if host is not None:
        hw = host[0].weight if isinstance(host[0], NVFP4Tensor) else host[0]
        assert hw.is_pinned() or hw.device == x.device, (
            "a host store read by the kernel must be pinned (page-locked) memory, or on the kernel's device"
        )
    return launch_moe_gemv(x, w13, w2, weights, ids, shared, host, down)


def shared_pair_alone(x: torch.Tensor, shared: tuple) -> torch.Tensor:
    """The shared expert's term alone, rounded as in a call with routed pairs (no routed pair:
    k = 0): what a batch whose routed pairs are streamed in groups adds to their fp32 sum."""
    s13, s2, _ = shared
    none = torch.zeros(x.shape[0], 0, dtype=torch.long, device=x.device)
    return fused_moe_gemv(x, s13[None], s2[None], none.float(), none, shared)
