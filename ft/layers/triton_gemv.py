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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous

GEMV_MAX_TOKENS = 4  # M = 5 .. 16 not timed yet
MAX_M = 16  # rows of x one program pads to (one MMA tile)
# (BLOCK_N, MAX_BLOCK_K, NUM_WARPS, NUM_STAGES), module constants so config_sweep can try others:
WIDE = (32, 256, 4, 3)  # in_proj 12352 x 2048 15.4 us, qkv 9216 x 2048 12.8 us at M=1
NARROW = (16, 512, 4, 4)  # out_proj 2048 x 4096 8.8 us, shared expert 1024 x 2048 5.1 us at M=1
WIDE_N = 4096  # output columns from which a projection takes WIDE


def config(n: int) -> tuple[int, int, int, int]:
    return WIDE if n >= WIDE_N else NARROW


@triton.jit
def _gemv_kernel(
    x, w, out, M, N, K, s_xm, s_wn, s_om,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_P)
    kk = tl.arange(0, BLOCK_K)
    nmask, mmask = n < N, m < M
    x_ptr = x + m[:, None].to(tl.int64) * s_xm + kk[None, :]  # [M_P, BK]
    w_ptr = w + n[:, None].to(tl.int64) * s_wn + kk[None, :]  # [BN, BK]
    acc = tl.zeros([M_P, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptr, mask=mmask[:, None], other=0.0)
            wt = tl.load(w_ptr, mask=nmask[:, None], other=0.0)
        else:
            kmask = (kk < K - k0)[None, :]
            xt = tl.load(x_ptr, mask=mmask[:, None] & kmask, other=0.0)
            wt = tl.load(w_ptr, mask=nmask[:, None] & kmask, other=0.0)
        acc += tl.dot(xt, tl.trans(wt))  # [M_P, BN], fp32
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    o_ptr = out + m[:, None].to(tl.int64) * s_om + n[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def launch_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x's dtype; checks and launches without the device check
    (the Triton interpreter runs it on CPU tensors)."""
    m, k = x.shape
    n, kw = w.shape
    shapes = f"x {tuple(x.shape)} and w {tuple(w.shape)}: need [M <= {MAX_M}, K] and [N, K]"
    assert kw == k and 0 < m <= MAX_M, shapes
    assert x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16), (
        f"x and w must share a bf16/fp16 dtype, got {x.dtype} and {w.dtype}"
    )
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, max_block_k, num_warps, num_stages = config(n)
    block_k = min(max_block_k, max(16, triton.next_power_of_2(k)))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        M_P=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=num_warps,
        num_stages=num_stages, **pdl_args(x),
    )  # fmt: skip
    return out


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``launch_gemv`` on CUDA tensors; graph-capturable (the grid comes from shapes)."""
    assert x.is_cuda and w.device == x.device, "gemv needs CUDA tensors on one device"
    return launch_gemv(x, w)
