"""Fused MoE for NVFP4 expert banks in Triton, W4A16: codes and scales are decoded in registers,
the products run as bf16 MMAs with fp32 accumulation (Hopper has no FP4 tensor cores).

Same contract and structure as ``triton_moe.fused_moe_triton`` (whose token->expert sort and
padding, ``align.align_by_expert``, and table lookup, ``pick_config``, it reuses; its tiles are its own,
``CONFIGS``):

    act = silu(g_gate · (x @ W_gate.T)) * (g_up · (x @ W_up.T))   # [T*k, I], SwiGLU fused
    y   = weights[t, k] · g_down · (act @ W_down.T)               # [T*k, H]
    out = sum_k y                                                 # [T, H]

where ``W = e2m1(code) · scale`` is decoded tile by tile (``fp4_decode``: integer ops only, the
values · 2^-22 exactly in bf16, the ``2^22`` folded into the global) and the per-row fp32 globals
``g`` are applied to the accumulator, after the dot. By default (``LUT``) the codes are decoded by
PTX byte tables instead, to the same values at their true magnitudes (no fold), the activations
read in that decode's order. Not here: the kernel (``triton_w4a16_kernel``), the operand checks
(``w4a16_operands``), a bank dequantised to bf16 (``w4a16_dequantize``), fp16 activations (the
folded magnitudes underflow fp16), W4A4, expert parallelism.
"""

from __future__ import annotations

import copy
import os

import torch
import triton

from ft.layers.pdl import pdl_args
from ft.moe.kernels import triton_moe
from ft.moe.kernels.fp4_decode import UNFOLD
from ft.moe.kernels.into import Into
from ft.moe.kernels.triton_moe import mma_path
from ft.moe.kernels.triton_w4a16_kernel import _w4a16_gemm_kernel
from ft.moe.kernels.w4a16_operands import check_operands
from ft.quant.nvfp4 import NVFP4Tensor

# The W4A16 kernel's tiles, laid out as ``triton_moe.CONFIGS`` (token bound, gate/up config, down
# config; first row whose bound >= T wins): the bf16 kernel's values, swept for a kernel its MMAs
# bound where this one is bound by decoding codes, but for Qwen3-Next's prefill chunks (above
# 2,048 tokens), swept with LUT decoding at T=8192 on an H200 (``tests/gpu/config_sweep.py
# grouped_w4a16``, 2026-12-04): 3.53 -> 3.20 ms (gate/up) and -> 3.38 ms (down) a call; an 8k
# prefill of the NVFP4 80B +7%. The other rows are not yet swept for this kernel.
CONFIGS = copy.deepcopy(triton_moe.BASE_CONFIGS)
CONFIGS["default"][-1] = (1 << 62, (128, 128, 128, 8, 8, 3), (64, 128, 64, 8, 4, 3))
CONFIGS = triton_moe.configs_from_env(CONFIGS, "FT_W4A16_PREFILL")  # its prefill rows for a process
# ``LUT`` (on since 2026-12-04; FT_W4A16_LUT=0 turns it off): codes decoded by PRMT byte
# tables in inline PTX (``decode_lut``), ~2.4 instructions a weight where ``decode`` takes ~14 at
# the prefill tiles (SASS, sm_90), the kernel then bound by decoding (a 1k prompt's grouped GEMMs
# were 52.6 of its 70.8 ms of kernels, 2026-12-01). Its K order within a step differs (two half-K
# products), so its bits differ from the byte decode's; the same values. H200, 2026-12-04: 41%
# faster than the byte decode at 17 and 64 tokens, 17% at 1k (docs/benchmarks.md). The transposed
# tiles once tried beside it (the decoded codes as wgmma's register operand) were slower at every
# size and are gone.
LUT = os.environ.get("FT_W4A16_LUT", "1") == "1"
# ``GLUON`` (off; FT_W4A16_GLUON=1 turns it on for a process and the ranks it spawns): calls of more
# than ``GLUON_MIN_TOKENS`` tokens (FT_W4A16_GLUON_MIN_TOKENS) run ``gluon_w4a16``'s kernel instead,
# the same arithmetic with a K step's decoding overlapped with the last step's wgmmas (this kernel's
# ``tl.dot`` waits for each wgmma group: the 8k gate/up launch at 140 TFLOP/s, docs/benchmarks.md
# 2026-12-04). On an H200 (2026-12-04 16:40 UTC, docs/benchmarks.md) its GPU tests pass and its
# output is this kernel's bit for bit, but it gains little: the MoE call 2-5% at 1k-16k tokens
# (gate/up at 8k 2.46 -> 2.30 ms under Nsight Compute, still one program an SM at 254 registers,
# its warps stalled on barriers and loads in turn), the 80B's resident 8k / 16k prefill +0.2% /
# +0.7%. Off: not worth a second path until it overlaps more (warp specialisation measured 26-48%
# slower and was removed, docs/benchmarks.md 2026-12-04 18:08; the decoded weights as the wgmma's
# register operand slower at 1k-16k tokens, removed 2026-12-05).
GLUON = os.environ.get("FT_W4A16_GLUON", "0") == "1"
GLUON_MIN_TOKENS = int(os.environ.get("FT_W4A16_GLUON_MIN_TOKENS", "512"))
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"  # runs no PTX: its kernels take Triton twins
# Up to this many tokens, ``triton_moe_gemv`` runs instead (no sort, no 16-row MMA padding), as
# timed against this path by tests/nvfp4/w4a16_timings.py on an H200. 2026-11-30 (config_sweep.py):
# 31.4 vs 46.4 us at T=1, 54.2 vs 73.1 at T=2, 98.5 vs 105.5 at T=4, so the limit was 2. Since
# then the GEMV reads its codes as words with block sums and integer products; 2026-12-03 21:50
# UTC (w4a16_timings.py, two runs; a call per distinct routing in a graph, E=512, I=512, top-10):
# GEMV 47.4 / 47.8 us against 103.0 / 102.8 at T=4, 84.8 / 84.3 against 167.6 / 169.6 at T=8,
# 157.2 / 157.1 against 285.8 / 294.4 at T=16 (64 and more not timed). The GEMV rounds each pair's
# term as this path does (see triton_moe.GEMV_MAX_TOKENS). Host reads keep their own limit
# (``host_reads.MAX_TOKENS``). FT_W4A16_GEMV_MAX_TOKENS=N sets it for a process (an A/B).
GEMV_MAX_TOKENS = int(os.environ.get("FT_W4A16_GEMV_MAX_TOKENS", "16"))


def takes_gemv(tokens: int, inter: int) -> bool:
    """Whether a call of ``tokens`` tokens (its batch's) takes the GEMV (any ``inter``, as timed)."""
    return 0 < tokens <= GEMV_MAX_TOKENS


def _launch(
    a,
    w: NVFP4Tensor,
    c,
    topk_w,
    align,
    num_pairs,
    n,
    k,
    topk,
    a_per_token,
    swiglu,
    mul_w,
    cfg,
    a_map=None,
    c_map=None,
):
    sorted_ids, block_expert, num_padded = align
    bm, bn, bk, group_m, warps, stages = cfg
    em = sorted_ids.shape[0]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    scale = w.weight_scale.view(torch.uint8)  # decoded from its bits in the kernel
    _w4a16_gemm_kernel[grid](
        a,
        w.weight,
        scale,
        w.weight_scale_2,
        c,
        topk_w,
        sorted_ids,
        block_expert,
        num_padded,
        em,
        n,
        k,
        num_pairs,
        a.stride(0),
        w.weight.stride(0),
        w.weight.stride(1),
        scale.stride(0),
        scale.stride(1),
        w.weight_scale_2.stride(0),
        c.stride(0),
        1.0 if LUT else UNFOLD,  # the LUT decode's values are at their true magnitudes
        sorted_ids if a_map is None else a_map,  # (unread without its flag)
        sorted_ids if c_map is None else c_map,
        TOPK=topk,
        A_PER_TOKEN=a_per_token,
        SWIGLU=swiglu,
        MUL_W=mul_w,
        EVEN_K=k % bk == 0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group_m,
        A_MAP=a_map is not None,
        C_MAP=c_map is not None,
        LUT=LUT,
        ASM=not INTERPRETER,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(a),
    )


def fused_moe_w4a16(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_tokens: int | None = None,
    into: Into | None = None,
    batch_experts: int | None = None,
) -> torch.Tensor:
    """x [T, H] bf16; w13 codes [E, 2I, H/2], scales [E, 2I, H/16], globals [E, 2I] (gate rows then
    up rows); w2 codes [E, H, I/2], scales [E, H, I/16], globals [E, H]; weights/ids [T, k] -> [T, H].
    ``batch_tokens``, ``batch_experts``: ``triton_moe.fused_moe_triton``'s (the batch's path and
    tiles when x is part of it or the bank holds other rows). ``into``: the call's tokens are rows
    of x and its terms go into rows of another tensor (``Into``)."""
    if into is not None:
        into.check(x, ids, takes_gemv(batch_tokens or len(ids), w2.weight.shape[-1] * 2))
    t = len(ids)
    if t > 0 and takes_gemv(batch_tokens or t, w2.weight.shape[-1] * 2):
        from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv  # it imports this module

        return fused_moe_gemv(x, w13, w2, weights, ids)
    assert x.is_cuda and w13.weight.device == x.device == w2.weight.device, (
        "fused_moe_w4a16 needs CUDA tensors on one device"
    )
    e, inter, topk = check_operands(x, w13, w2, weights, ids, tokens=t)
    if t == 0:
        return torch.zeros_like(x) if into is None else into.out
    tiles = batch_tokens or t  # the batch's kernel and tiles, so its pairs' terms have its bits
    if GLUON and tiles > GLUON_MIN_TOKENS:
        from ft.moe.kernels import gluon_w4a16  # Gluon: compiled only where it runs

        if gluon_w4a16.supports(w13, w2, x):
            configs = gluon_w4a16.CONFIGS
            return mma_path(
                gluon_w4a16.launch, x, w13, w2, weights, ids, e, inter, into, configs, tiles, batch_experts
            )
    return mma_path(_launch, x, w13, w2, weights, ids, e, inter, into, CONFIGS, tiles, batch_experts)
