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
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ft.layers.gemv_tiles import gemv_tile, split_k_sum
from ft.layers.pdl import pdl_args, wait_for_previous

GEMV_MAX_TOKENS = 4  # M = 5 .. 16 not timed yet
MAX_M = 16  # rows of x one program pads to (one MMA tile)
# (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, NUM_STAGES), module constants so config_sweep can try others:
WIDE = (32, 256, 4, 3)  # in_proj 12352 x 2048 15.4 us, qkv 9216 x 2048 12.8 us at M=1
NARROW = (16, 512, 4, 4)  # out_proj 2048 x 4096 8.8 us, shared expert 1024 x 2048 5.1 us at M=1
WIDE_N = 4096  # output columns from which a projection takes WIDE

# OFF: timed no faster on an H200 (docs/benchmarks.md, 2026-12-01: the 80B's batch-1 decode with
# NVFP4 experts 287.3 tok/s without, 285.9 with out_proj split). The fused router always splits.
# FT_GEMV_SPLIT_K=1 turns it on for a process and the ranks it spawns.
SPLIT_K = os.environ.get("FT_GEMV_SPLIT_K", "0") != "0"
PROGRAMS_PER_SM = 2  # split until a projection has about this many programs per SM
MAX_SPLITS = 8
MIN_SPLIT_K = 256  # inputs one split reads at the least
COUNTERS = 1 << 16  # tickets per device: one per column block (and one per launch for the router)


def config(n: int) -> tuple[int, int, int, int]:
    return WIDE if n >= WIDE_N else NARROW


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T is a product for the GEMV: at most ``GEMV_MAX_TOKENS`` rows of bf16/fp16 on
    a GPU, w of x's dtype."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_TOKENS
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
    )


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


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``launch_gemv`` on CUDA tensors; graph-capturable (the grid comes from shapes)."""
    assert x.is_cuda and w.device == x.device, "gemv needs CUDA tensors on one device"
    return launch_gemv(x, w)
