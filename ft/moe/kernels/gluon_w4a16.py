"""The Gluon W4A16 kernel (``gluon_w4a16_kernel``: decoding overlapped with the wgmmas) as
``triton_w4a16.fused_moe_w4a16`` runs it with ``triton_w4a16.GLUON`` on, above
``triton_w4a16.GLUON_MIN_TOKENS`` tokens: its tiles (``CONFIGS``), the calls it takes
(``supports``), its layouts (``layouts``) and its launch (``launch``, ``triton_w4a16._launch``'s
contract).

Run on an H200 on 2026-12-04 (docs/benchmarks.md): its GPU tests pass, its output equals the
Triton kernel's bit for bit, the MoE call is 2-5% faster at 1k-16k tokens and the 80B's prefill
0.2-0.7%; off (``triton_w4a16.GLUON``, FT_W4A16_GLUON=1): under Nsight Compute the 8k gate/up
launch runs one program an SM, its 8 warps stalled in turn on barriers, loads and the table
decode's shared-memory reads (12.5% occupancy, 33% of the SMs' issue rate). Takes the calls
``supports`` says fit (K a multiple of 256 and aligned tensors, for whole 16-byte copies:
Qwen3-Next's experts and their TP=2 shards), the others run the Triton kernel; BLOCK_M is 16 x
warps (one wgmma row block a warp).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental.gluon import language as gl

from ft.moe.kernels import triton_moe
from ft.moe.kernels.gluon_w4a16_kernel import SCALE_UNIT, _w4a16_wgmma_kernel
from ft.quant.nvfp4 import NVFP4Tensor

STAGES = 3  # copy slots (activations, codes, scales; cp.async groups in flight: STAGES - 1)
# its tiles, laid out as ``triton_moe.CONFIGS`` (it runs above ``triton_w4a16.GLUON_MIN_TOKENS``; a
# config's last entry, stages, is unused): up to 2,048 tokens 64-row tiles at 4 warps (an expert
# gets ~40 pairs of a 2k call: 128 rows would be mostly padding; gate/up 64 + 64 columns, 128
# registers), above gate/up 128 x (128 + 128) x 64 at 8 warps (255 registers, 139 KB of shared
# memory compiled for sm_90) and down 64 x 128 x 64 at 4 (167 registers, 70 KB).
# FT_W4A16_GLUON_TILES=UP/DOWN sets the last row for a process. Not yet swept.
_UP, _DOWN = (128, 128, 64, 8, 8, 3), (64, 128, 64, 8, 4, 3)
_SMALL_UP = (64, 64, 64, 8, 4, 3)
CONFIGS = triton_moe.configs_from_env(
    {name: [(2048, _SMALL_UP, _DOWN), (1 << 62, _UP, _DOWN)] for name in ("default", "E128")},
    "FT_W4A16_GLUON_TILES",
)


def supports(w13: NVFP4Tensor, w2: NVFP4Tensor, x: torch.Tensor | None = None) -> bool:
    """Whether banks gate/up ``w13`` and down ``w2`` (and activations ``x``: 16-byte aligned rows for
    their 8-byte copies) fit the kernel (else the Triton kernel runs): K
    (H, then I) a multiple of every row's BLOCK_K with at least STAGES - 1 steps, and every copy of
    codes and scales 16-byte aligned (cp.async has no byte copies): the tensors' starts, expert
    strides and row strides (K/2 and K/16 bytes) multiples of 16, so K a multiple of 256. A TP=4
    shard of Qwen3-Next's experts (I = 128) takes the Triton kernel."""
    if x is not None and (x.data_ptr() % 16 or x.stride(0) % 16 or x.stride(-1) != 1):
        return False
    for w, which in ((w13, 0), (w2, 1)):
        k = 2 * w.weight.shape[-1]
        for rows in CONFIGS.values():
            for row in rows:
                bk = row[1 + which][2]
                if k % bk or k // bk < STAGES - 1:
                    return False
        for t in (w.weight, w.weight_scale):
            if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st % 16 for st in t.stride()[:-1]):
                return False
    return True


def layouts(block_m: int, block_n: int, block_k: int, warps: int) -> dict:
    """The kernel's layouts for its tiles (constexpr arguments): the wgmma accumulators' (a row
    block of 16 a warp, the whole BLOCK_N an instruction); the copies' (activations four a thread,
    codes 16 bytes, a row's scales at once); the decode's (P3: a 16-input block's 8 code bytes a
    thread, B2 the same as [BN, BK/2]); the plain shared layout of codes and scales and the two
    MMA operands' swizzles."""
    hk = block_k // 2
    assert block_m == 16 * warps and warps in (4, 8), f"BLOCK_M {block_m} is not 16 x warps ({warps})"
    assert hk in (32, 64) and block_n % 8 == 0 and block_n <= 256, (block_n, block_k)
    return dict(
        MMA=gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16]
        ),
        IO=gl.BlockedLayout([1, 4], [128 // hk, hk // 4], [warps, 1], [1, 0]),
        CODES=gl.BlockedLayout([1, 16], [512 // hk, hk // 16], [warps, 1], [1, 0]),  # 16-byte copies
        SCALES=gl.BlockedLayout([1, hk // 8], [32, 1], [warps, 1], [1, 0]),  # a row's scales a copy
        PLAIN=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        P3=gl.BlockedLayout([1, 1, 8], [256 // hk, hk // 8, 1], [warps, 1, 1], [2, 1, 0]),  # a block a thread
        B2=gl.BlockedLayout([1, 8], [256 // hk, hk // 8], [warps, 1], [1, 0]),  # P3's [BN, BK/2]
        A_SMEM=gl.NVMMASharedLayout.get_default_for([block_m, hk], gl.bfloat16),
        B_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, hk], gl.bfloat16),
    )


def launch(a, w: NVFP4Tensor, c, topk_w, align, num_pairs, n, k, topk, a_per_token, swiglu, mul_w, cfg,
           a_map=None, c_map=None):  # fmt: skip
    """``triton_w4a16._launch``'s contract (cfg = BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages;
    the copy slots are ``STAGES``, not the config's stages)."""
    sorted_ids, block_expert, num_padded = align
    bm, bn, bk, group_m, warps, _ = cfg
    assert k % bk == 0 and k // bk >= STAGES - 1, f"K={k}: a multiple of {bk}, at least {STAGES - 1} steps"
    assert a.dtype == torch.bfloat16 and a.stride(1) == 1, "bf16 activations, rows contiguous"
    em = sorted_ids.shape[0]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    scale = w.weight_scale.view(torch.uint8)
    unit = SCALE_UNIT.value
    assert scale.stride(0) % unit == 0 and scale.stride(1) % unit == 0, (
        f"scale strides {scale.stride()}: not multiples of {unit} bytes (``supports``)"
    )
    _w4a16_wgmma_kernel[grid](
        a, w.weight, scale, w.weight_scale_2, c, topk_w, sorted_ids, block_expert, num_padded,
        em, n, k, num_pairs, a.stride(0), w.weight.stride(0), w.weight.stride(1),
        scale.stride(0) // unit, scale.stride(1) // unit, w.weight_scale_2.stride(0), c.stride(0),
        sorted_ids if a_map is None else a_map, sorted_ids if c_map is None else c_map,
        TOPK=topk, A_PER_TOKEN=a_per_token, SWIGLU=swiglu, MUL_W=mul_w, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=group_m, A_MAP=a_map is not None, C_MAP=c_map is not None, STAGES=STAGES,
        **layouts(bm, bn, bk, warps), num_warps=warps,
    )  # fmt: skip
