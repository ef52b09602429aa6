"""The pieces of a grouped MoE GEMM program that every MMA kernel shares (bf16: ``triton_moe_kernel``;
W4A16: ``triton_w4a16_kernel``, ``gluon_w4a16_kernel``): which sorted pairs and output columns a
program takes (``pair_tile``, ``tile_pairs``) and where its results go (``store_pairs``). Not here:
the sort itself (``align``), the tile tables and the launches (``triton_moe``, ``triton_w4a16``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pair_tile(pid, EM, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # a grouped GEMM program -> (its BLOCK_M rows of the sorted pairs, its BLOCK_N columns), the
    # programs of GROUP_M consecutive row blocks taking each column block in turn (their experts'
    # columns stay in L2 across those row blocks)
    num_m = tl.cdiv(EM, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def tile_pairs(
    pid_m, pid_n, sorted_ids, block_expert, num_pairs, N, a_map,
    TOPK: tl.constexpr, A_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    A_MAP: tl.constexpr,
):  # fmt: skip
    # a tile's expert, its flat pair ids [BM] (the padding's id, num_pairs, masked off), the input
    # row each reads (its token's, or its own; ``A_MAP``: that row's entry of a_map, a row of a
    # larger batch), and its output columns [BN]
    e = tl.load(block_expert + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rmask = rows < num_pairs
    a_rows = (rows // TOPK) if A_PER_TOKEN else rows
    if A_MAP:
        a_rows = tl.load(a_map + a_rows, mask=rmask, other=0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, rmask, a_rows, n, n < N


@triton.jit
def store_pairs(acc, c, topk_w, rows, rmask, n, nmask, s_cm, c_map, MUL_W: tl.constexpr, C_MAP: tl.constexpr):
    # a tile's fp32 results, times each pair's routing weight (``MUL_W``), into its rows of c (or
    # with ``C_MAP`` each pair's entry of c_map)
    if MUL_W:
        acc = acc * tl.load(topk_w + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    if C_MAP:
        rows = tl.load(c_map + rows, mask=rmask, other=0)
    c_ptr = c + rows[:, None].to(tl.int64) * s_cm + n[None, :]
    tl.store(c_ptr, acc.to(c.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])
