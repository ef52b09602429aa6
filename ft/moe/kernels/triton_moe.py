"""Fused MoE for bf16/fp16 expert banks in Triton: sort, two grouped GEMMs, sum over top-k.

Same contract as ``torch_ref.fused_moe_ref(x, w13, w2, weights, ids) -> [T, H]``:

    pairs  = (token, k) flattened, sorted by expert, each expert's run padded to BLOCK_M rows
    act    = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)        # [T*k, I], SwiGLU fused in GEMM 1
    y      = weights[t, k] * (act @ w2[e].T)                    # [T*k, H], routing weight in GEMM 2
    out    = sum_k y                                            # [T, H]

The sort and padding (``align.align_by_expert``: one Triton program for decode sizes, three
launches above) have shapes fixed by (T, k, E) and no host sync, so a decode step can be captured
in a CUDA graph. Up to
``GEMV_MAX_TOKENS`` tokens ``triton_moe_gemv`` runs instead. Configs come
from a small table by tokens per call (``CONFIGS``), seeded from vLLM's H200 tunings for
E=512/N=512 and E=128/N=768. Not here: the kernel (``triton_moe_kernel``) and the tile pieces
every MMA kernel shares (``grouped_tiles``), quantised weights (NVFP4 has its own kernel), expert
parallelism, bias terms.
"""

from __future__ import annotations

import copy
import os

import torch
import triton

from ft.layers.pdl import pdl_args
from ft.moe.kernels.align import align_by_expert
from ft.moe.kernels.into import Into
from ft.moe.kernels.triton_combine import sum_topk
from ft.moe.kernels.triton_moe_kernel import _grouped_gemm_kernel

# Up to this many tokens, ``triton_moe_gemv`` runs instead (no sort, no 16-row MMA padding, two
# launches), for experts of at most GEMV_MAX_INTER intermediate rows; wider experts keep the MMA path.
# H200, 2026-11-30 (tests/gpu/config_sweep.py, per call of a graph of calls over 8 routings):
# E=512, I=512, top-10 (02:50 UTC): GEMV 28.1 vs MMA 30.7 us at T=1, 40.2 vs 48.5 at T=2, 70.0 vs
# 84.7 at T=4; E=128, I=768, top-8 (Qwen3-30B, 04:39 UTC): 35.0 vs 30.9, 48.6 vs 48.6, 87.6 vs 80.6.
# The GEMV rounds each pair's term as the MMA path does, and a streamed offload batch takes its
# batch's path (``batch_tokens``): the bf16 offload-vs-resident GPU tests pass with it on (04:20 UTC).
GEMV_MAX_TOKENS = 4
GEMV_MAX_INTER = 512


def takes_gemv(tokens: int, inter: int) -> bool:
    """Whether a call of ``tokens`` tokens (its batch's) over experts of ``inter`` rows takes the GEMV."""
    return 0 < tokens <= GEMV_MAX_TOKENS and inter <= GEMV_MAX_INTER


def configs_from_env(table: dict, variable: str) -> dict:
    """``table`` with the gate/up and down tiles of its last rows (a prefill chunk's calls) set by
    the environment variable ``variable`` = BM,BN,BK,G,W,S/BM,BN,BK,G,W,S, if set, for a process
    and the ranks it spawns: what a sweep's best (tests/gpu/config_sweep.py) is benchmarked with in
    the engine before it is written into the table."""
    value = os.environ.get(variable)
    if value:
        up, down = (tuple(int(v) for v in part.split(",")) for part in value.split("/"))
        for rows in table.values():
            rows[-1] = (rows[-1][0], up, down)
    return table


# (max tokens per call) -> (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for GEMM 1
# (fused gate+up: BLOCK_N columns of each) and GEMM 2 (down). First row whose bound >= T wins.
# FT_MOE_PREFILL sets the last rows for a process (``configs_from_env``); ``BASE_CONFIGS`` is the
# table as written, which the W4A16 kernel's starts from.
BASE_CONFIGS: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {
    "default": [
        (1, (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4)),
        (16, (16, 64, 128, 1, 4, 3), (16, 128, 64, 1, 4, 3)),
        (64, (16, 64, 128, 1, 4, 3), (16, 128, 128, 1, 8, 3)),
        (512, (32, 64, 128, 8, 4, 3), (32, 128, 64, 8, 4, 3)),
        (2048, (64, 64, 64, 8, 4, 3), (64, 128, 64, 8, 4, 3)),
        (1 << 62, (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3)),
    ],
    # Qwen3-30B-A3B: E=128, I=768 (more tokens per expert at the same T)
    "E128": [
        (1, (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4)),
        (16, (16, 64, 128, 1, 4, 3), (16, 64, 128, 1, 4, 3)),
        (64, (16, 128, 128, 1, 8, 2), (16, 128, 128, 1, 8, 2)),
        (256, (32, 128, 64, 8, 4, 3), (32, 128, 64, 8, 4, 3)),
        (1 << 62, (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3)),
    ],
}
CONFIGS = configs_from_env(copy.deepcopy(BASE_CONFIGS), "FT_MOE_PREFILL")


def pick_config(
    num_tokens: int, num_experts: int, configs: dict | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(gate/up config, down config) for a call of ``num_tokens`` from ``configs`` (a table laid out
    as ``CONFIGS``, which it defaults to)."""
    configs = CONFIGS if configs is None else configs
    table = configs["E128"] if num_experts <= 128 else configs["default"]
    for bound, up, down in table:
        if num_tokens <= bound:
            return up, down
    raise AssertionError("the last CONFIGS row must cover every T")


def _launch(
    a, b, c, topk_w, align, num_pairs, n, k, topk, a_per_token, swiglu, mul_w, cfg, a_map=None, c_map=None
):
    sorted_ids, block_expert, num_padded = align
    bm, bn, bk, group_m, warps, stages = cfg
    em = sorted_ids.shape[0]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a,
        b,
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
        b.stride(0),
        b.stride(1),
        c.stride(0),
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
        num_warps=warps,
        num_stages=stages,
        **pdl_args(a),
    )


def check_operands(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tokens: int | None = None,
) -> tuple[int, int, int]:
    """Shapes, dtypes and strides both bf16/fp16 paths (MMA and GEMV) need; returns (E, I, k).
    ``tokens``: the call's, where they are rows of x (``Into``)."""
    t, h = x.shape
    t = t if tokens is None else tokens
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    topk = ids.shape[1]
    assert h13 == h and two_i % 2 == 0, f"w13 {tuple(w13.shape)} does not fit x [T, {h}]"
    assert w2.shape == (e, h, inter), f"w2 {tuple(w2.shape)} is not [{e}, {h}, {inter}]"
    assert weights.shape == ids.shape == (t, topk), f"weights/ids must be [{t}, k], got {tuple(ids.shape)}"
    assert x.dtype == w13.dtype == w2.dtype and x.dtype in (torch.bfloat16, torch.float16), (
        f"x/w13/w2 must share a bf16/fp16 dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}"
    )
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights must be row-major in their last dim"
    return e, inter, topk


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_tokens: int | None = None,
    into: Into | None = None,
    batch_experts: int | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [T, k] -> [T, H].
    ``batch_tokens``: the batch whose path to take (GEMV or MMA) when x is a part of it, and
    ``batch_experts`` its model's experts when w13 holds other rows (a cache's slots, a staging
    buffer): the tiles are that batch's (``mma_path``). ``into``: the call's tokens are rows of x
    and its terms go into rows of another tensor (``Into``)."""
    if into is not None:
        into.check(x, ids, takes_gemv(batch_tokens or len(ids), w2.shape[-1]))
    t = len(ids)
    if t > 0 and takes_gemv(batch_tokens or t, w2.shape[-1]):
        from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv  # it imports this module

        return fused_moe_gemv(x, w13, w2, weights, ids)
    assert x.is_cuda and w13.device == x.device, "fused_moe_triton needs CUDA tensors on one device"
    e, inter, topk = check_operands(x, w13, w2, weights, ids, tokens=t)
    if t == 0:
        return torch.zeros_like(x) if into is None else into.out
    return mma_path(_launch, x, w13, w2, weights, ids, e, inter, into, None, batch_tokens, batch_experts)


def mma_path(
    launch, x, w13, w2, weights, ids, e: int, inter: int, into: Into | None, configs: dict | None = None,
    batch_tokens: int | None = None, batch_experts: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """A fused MoE call's MMA path (bf16 and W4A16 alike, ``launch`` the kernel's launcher, its
    tiles from ``configs``, ``CONFIGS`` unless given): the pairs sorted by expert and padded,
    gate/up with SwiGLU into act [T*k, I], down weighted into y [T*k, H] (or ``into``'s rows,
    returned), the top-k sum. The tiles are the batch's (``batch_tokens``, when the call's pairs
    are part of one; ``batch_experts``, its model's experts, when the bank holds other rows): a
    tile's K step sets the order of each row's sums (the W4A16 table decode reads a step's K in
    its own order), so a pair's term has the bits the whole batch's call gives it only at the
    tiles that call takes; the offload backend's streamed calls of a few pairs each took smaller
    ones, and from a staging buffer of up to 128 rows the table of 128-expert models, and a
    prompt's last bits then followed what the expert cache held."""
    t, h, topk = len(ids), x.shape[1], ids.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    up_cfg, down_cfg = pick_config(batch_tokens or t, batch_experts or e, configs)
    topk_w = weights.reshape(-1).float().contiguous()  # [T*k]
    pairs = t * topk
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    align = align_by_expert(ids, e, up_cfg[0])
    a_map = None if into is None else into.tokens
    launch(x, w13, act, topk_w, align, pairs, inter, h, topk, True, True, False, up_cfg, a_map=a_map)
    if down_cfg[0] != up_cfg[0]:
        align = align_by_expert(ids, e, down_cfg[0])
    if into is not None:  # each pair's weighted term into its row of ``into.out``
        launch(act, w2, into.out, topk_w, align, pairs, h, inter, topk, False, False, True, down_cfg,
               c_map=into.rows)  # fmt: skip
        return into.out
    y = torch.empty(pairs, h, dtype=x.dtype, device=x.device)  # [T*k, H], weighted
    launch(act, w2, y, topk_w, align, pairs, h, inter, topk, False, False, True, down_cfg)
    if topk == 1:  # one term a token, already rounded: its sum is itself (the offload backend's calls)
        return y
    return sum_topk(y.view(t, topk, h))  # accumulates in fp32, rounds once
