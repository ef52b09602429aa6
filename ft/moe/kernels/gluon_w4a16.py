"""The W4A16 grouped GEMM's prefill tiles in Gluon (Hopper), with decoding overlapped with the MMAs.

``triton_w4a16._w4a16_gemm_kernel`` decodes a K step's codes in registers and stores them to
shared memory for ``tl.dot``; Triton then waits for every wgmma group before the next step's
decoded tile overwrites that buffer (``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each dot, SASS for
sm_90, 2026-12-04), so decoding and MMA never overlap: at an 8k chunk the gate/up launch runs at
140 TFLOP/s with 255 registers and one program an SM (Nsight Compute, docs/benchmarks.md). Here the
loop is written out (Gluon: explicit layouts, shared memory and wgmma groups):

    step i:  load step i+1's codes and scales (registers)
             decode step i by the PTX byte tables (``triton_w4a16.LUT_LO/HI``) while step i-1's
             wgmmas run, store it to decoded buffer i % 2 (two buffers)
             wait for step i's activations (cp.async, STAGES buffers, issued STAGES-1 steps ahead)
             fence, barrier, issue step i's wgmmas (async), wait until only they are in flight,
             barrier (every warpgroup is past step i-1: its buffers are free), issue the
             activations of step i+STAGES-1 into step i-1's buffer

The arithmetic is ``triton_w4a16``'s LUT path: per K step of BLOCK_K inputs two half-K products
(the activations read in the table decode's order, ``ka``), fp32 accumulators, the rows'
globals, SwiGLU and the routing weight applied after the loop, the same pairs' rows and padding
(``align_by_expert``). The bits may differ from the Triton kernel's (wgmma's K order within a
step), the values agree to fp32 accumulation.

NOT yet run on a GPU (written 2026-12-04 on a machine without one; compiled for sm_90 with Triton
3.6 by tests/gpu/compile_check.py): off until a GPU test passes and a timing wins
(``triton_w4a16.GLUON``, FT_W4A16_GLUON=1). Supports the prefill tiles only: BLOCK_M 16 x warps
(one wgmma row block per warp), K a multiple of BLOCK_K with at least STAGES - 1 steps.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ft.moe.kernels import triton_moe, triton_w4a16
from ft.moe.kernels.triton_moe import pair_tile, store_pairs
from ft.moe.kernels.triton_w4a16 import e4m3
from ft.quant.nvfp4 import NVFP4Tensor

LUT_LO = gl.constexpr(triton_w4a16.LUT_LO.value)
LUT_HI = gl.constexpr(triton_w4a16.LUT_HI.value)
STAGES = 3  # activation buffers (cp.async groups in flight: STAGES - 1)
# its tiles, laid out as ``triton_moe.CONFIGS`` (it runs above ``triton_w4a16.GLUON_MIN_TOKENS``; a
# config's last entry, stages, is unused): up to 2,048 tokens 64-row tiles at 4 warps (an expert
# gets ~40 pairs of a 2k call: 128 rows would be mostly padding; gate/up 64 + 64 columns), above
# gate/up 128 x (128 + 128) x 64 at 8 warps (255 registers, 112 KB of shared memory compiled for
# sm_90) and down 64 x 128 x 64 at 4 (167 registers, 56 KB). FT_W4A16_GLUON_TILES=UP/DOWN sets the
# last row for a process. Not yet swept: nothing here has run on a GPU.
_UP, _DOWN = (128, 128, 64, 8, 8, 3), (64, 128, 64, 8, 4, 3)
_SMALL_UP = (64, 64, 64, 8, 4, 3)  # 128 columns at 4 warps spill (204 B)
CONFIGS = triton_moe.configs_from_env(
    {name: [(2048, _SMALL_UP, _DOWN), (1 << 62, _UP, _DOWN)] for name in ("default", "E128")},
    "FT_W4A16_GLUON_TILES",
)
NEW_BARRIER = gl.constexpr(hasattr(gl, "barrier"))  # Triton 3.6's thread_barrier is 3.8's barrier


@gluon.jit
def _cta_barrier():
    # every thread of the program past this point (Triton 3.6 on the GPU machines, 3.8 in CI)
    if NEW_BARRIER:
        gl.barrier()
    else:
        gl.thread_barrier()


@gluon.jit
def _load_codes(b_e, s_e, n, kh, k0, s_bn, s_sn, nmask):
    # one K step's packed codes [BN, BK/2] (uint8, four consecutive bytes a thread: one word) and
    # each byte's block scale, gathered in the same shape (a 16-input block is 8 bytes)
    rows = n[:, None].to(gl.int64)
    codes = gl.load(b_e + rows * s_bn + (k0 // 2 + kh)[None, :], mask=nmask[:, None], other=0)
    scale = gl.load(s_e + rows * s_sn + (k0 // 16 + kh // 8)[None, :], mask=nmask[:, None], other=0)
    return codes, scale


@gluon.jit
def _decode(codes, scale):
    # ``triton_w4a16._decode_lut``'s halves (wa: inputs 8q + i, wb: 8q + 4 + i at position 4q + i)
    s = (e4m3(scale) * 256.0).to(gl.bfloat16)  # exact: e4m3 has 4 significant bits
    wa = gl.inline_asm_elementwise(LUT_LO, "=r,=r,r,r,r", [codes, s], gl.bfloat16, True, 4)
    wb = gl.inline_asm_elementwise(LUT_HI, "=r,=r,r,r,r", [codes, s], gl.bfloat16, True, 4)
    return wa, wb


@gluon.jit
def _issue_acts(a_ptr0, rmask, k0, K, dst0, dst1):
    # one K step's two activation halves (columns ka and ka + 4) into their buffers, one group
    m = rmask[:, None] & (k0 < K)
    async_copy.async_copy_global_to_shared(dst0, a_ptr0 + k0, mask=m)
    async_copy.async_copy_global_to_shared(dst1, a_ptr0 + (k0 + 4), mask=m)
    async_copy.commit_group()


# a call's pair count, where its weights and row maps start (slices of a batch's): one variant for
# all, as ``triton_w4a16._w4a16_gemm_kernel``
@gluon.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _w4a16_wgmma_kernel(
    a, b, b_scale, b_global, c, topk_w, sorted_ids, block_expert, num_padded,
    EM, N, K, num_pairs, s_am, s_be, s_bn, s_se, s_sn, s_ge, s_cm, a_map, c_map,
    TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr, SWIGLU: gl.constexpr, MUL_W: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    A_MAP: gl.constexpr, C_MAP: gl.constexpr, STAGES: gl.constexpr,
    MMA: gl.constexpr, IO: gl.constexpr, A_SMEM: gl.constexpr, B_SMEM: gl.constexpr,
):  # fmt: skip
    HK: gl.constexpr = BLOCK_K // 2
    ROWS_IO: gl.constexpr = gl.SliceLayout(1, IO)
    COLS_IO: gl.constexpr = gl.SliceLayout(0, IO)
    ROWS_MMA: gl.constexpr = gl.SliceLayout(1, MMA)
    COLS_MMA: gl.constexpr = gl.SliceLayout(0, MMA)
    # the program's tile (GROUP_M row blocks take each column block in turn)
    pid_m, pid_n = pair_tile(gl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(num_padded):
        return
    e = gl.load(block_expert + pid_m).to(gl.int64)
    # the tile's pairs and the input rows they read (``triton_moe.tile_pairs``), in the layout the
    # activation copies take
    rows = gl.load(sorted_ids + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROWS_IO))
    rmask = rows < num_pairs
    a_rows = (rows // TOPK) if A_PER_TOKEN else rows
    if A_MAP:
        a_rows = gl.load(a_map + a_rows, mask=rmask, other=0)
    kh = gl.arange(0, HK, layout=COLS_IO)
    ka = (kh // 4) * 8 + kh % 4  # the table decode's inputs (wa's; wb's are 4 further)
    a_ptr0 = a + a_rows[:, None].to(gl.int64) * s_am + ka[None, :]
    n_io = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS_IO)
    nmask_io = n_io < N
    b_e = b + e * s_be
    s_e = b_scale + e * s_se

    a0_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HK], A_SMEM)
    a1_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HK], A_SMEM)
    ga_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)
    gb_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)
    if SWIGLU:
        ua_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)
        ub_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)

    steps = K // BLOCK_K
    for s in gl.static_range(STAGES - 1):  # the first activations
        _issue_acts(a_ptr0, rmask, s * BLOCK_K, K, a0_s.index(s), a1_s.index(s))
    g_codes, g_scale = _load_codes(b_e, s_e, n_io, kh, 0, s_bn, s_sn, nmask_io)
    if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
        u_codes, u_scale = _load_codes(b_e + N * s_bn, s_e + N * s_sn, n_io, kh, 0, s_bn, s_sn, nmask_io)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    for i in range(steps):
        k0 = i * BLOCK_K
        buf = i % 2
        slot = i % STAGES
        # this step's decode (step i-1's wgmmas may still run); its buffer was last read by step
        # i-2, which every warpgroup finished before the last step's closing barrier
        wa, wb = _decode(g_codes, g_scale)
        ga_s.index(buf).store(wa)
        gb_s.index(buf).store(wb)
        if SWIGLU:
            ua, ub = _decode(u_codes, u_scale)
            ua_s.index(buf).store(ua)
            ub_s.index(buf).store(ub)
        # the next step's codes in flight while this one multiplies (masked past the last step)
        nmask_next = nmask_io & (k0 + BLOCK_K < K)
        g_codes, g_scale = _load_codes(b_e, s_e, n_io, kh, k0 + BLOCK_K, s_bn, s_sn, nmask_next)
        if SWIGLU:
            u_codes, u_scale = _load_codes(
                b_e + N * s_bn, s_e + N * s_sn, n_io, kh, k0 + BLOCK_K, s_bn, s_sn, nmask_next
            )
        async_copy.wait_group(STAGES - 2)  # this step's activations have landed (this thread's)
        fence_async_shared()
        _cta_barrier()  # ... and every thread's, and every decoded tile is stored
        a0 = a0_s.index(slot)
        a1 = a1_s.index(slot)
        acc = warpgroup_mma(a0, ga_s.index(buf).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a1, gb_s.index(buf).permute((1, 0)), acc, is_async=True)
        if SWIGLU:
            acc_up = warpgroup_mma(a0, ua_s.index(buf).permute((1, 0)), acc_up, is_async=True)
            acc_up = warpgroup_mma(a1, ub_s.index(buf).permute((1, 0)), acc_up, is_async=True)
            acc, acc_up = warpgroup_mma_wait(num_outstanding=4, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
        _cta_barrier()  # every warpgroup is past step i-1: its activation buffer is free
        nxt = (i + STAGES - 1) % STAGES
        _issue_acts(a_ptr0, rmask, k0 + (STAGES - 1) * BLOCK_K, K, a0_s.index(nxt), a1_s.index(nxt))
    if SWIGLU:
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    # the epilogue, in the accumulators' layout: globals, SwiGLU, routing weight, the pairs' rows
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=COLS_MMA)
    nmask = n < N
    g_ptr = b_global + e * s_ge + n
    acc = acc * gl.load(g_ptr, mask=nmask, other=0.0)[None, :]
    if SWIGLU:
        acc_up = acc_up * gl.load(g_ptr + N, mask=nmask, other=0.0)[None, :]
        acc = acc / (1.0 + gl.exp(-acc)) * acc_up
    out_rows = gl.load(sorted_ids + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROWS_MMA))
    omask = out_rows < num_pairs
    store_pairs(acc, c, topk_w, out_rows, omask, n, nmask, s_cm, c_map, MUL_W, C_MAP)


def supports(h: int, inter: int) -> bool:
    """Whether a bank of hidden size ``h`` and ``inter`` intermediate rows fits the kernel's tiles
    (K a multiple of BLOCK_K with STAGES - 1 steps, for gate/up and down); else the Triton kernel runs."""
    return all(
        k % cfg[2] == 0 and k // cfg[2] >= STAGES - 1
        for rows in CONFIGS.values()
        for _, *cfgs in rows
        for k, cfg in zip((h, inter), cfgs)
    )


def layouts(block_m: int, block_n: int, block_k: int, warps: int) -> dict:
    """The kernel's layouts for its tiles (constexpr arguments): the wgmma accumulators' (a row
    block of 16 a warp, the whole BLOCK_N an instruction), the register tiles' (four consecutive
    bytes or activations a thread), and the two operands' shared-memory swizzles."""
    hk = block_k // 2
    assert block_m == 16 * warps and warps in (4, 8), f"BLOCK_M {block_m} is not 16 x warps ({warps})"
    assert 16 <= hk <= 128 and block_n % 8 == 0 and block_n <= 256, (block_n, block_k)
    return dict(
        MMA=gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16]
        ),
        IO=gl.BlockedLayout([1, 4], [128 // hk, hk // 4], [warps, 1], [1, 0]),
        A_SMEM=gl.NVMMASharedLayout.get_default_for([block_m, hk], gl.bfloat16),
        B_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, hk], gl.bfloat16),
    )


def launch(a, w: NVFP4Tensor, c, topk_w, align, num_pairs, n, k, topk, a_per_token, swiglu, mul_w, cfg,
           a_map=None, c_map=None):  # fmt: skip
    """``triton_w4a16._launch``'s contract (cfg = BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages;
    the activation buffers are ``STAGES``, not the config's stages)."""
    sorted_ids, block_expert, num_padded = align
    bm, bn, bk, group_m, warps, _ = cfg
    assert k % bk == 0 and k // bk >= STAGES - 1, f"K={k}: a multiple of {bk}, at least {STAGES - 1} steps"
    assert a.dtype == torch.bfloat16 and a.stride(1) == 1, "bf16 activations, rows contiguous"
    em = sorted_ids.shape[0]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    scale = w.weight_scale.view(torch.uint8)
    _w4a16_wgmma_kernel[grid](
        a, w.weight, scale, w.weight_scale_2, c, topk_w, sorted_ids, block_expert, num_padded,
        em, n, k, num_pairs, a.stride(0), w.weight.stride(0), w.weight.stride(1), scale.stride(0),
        scale.stride(1), w.weight_scale_2.stride(0), c.stride(0),
        sorted_ids if a_map is None else a_map, sorted_ids if c_map is None else c_map,
        TOPK=topk, A_PER_TOKEN=a_per_token, SWIGLU=swiglu, MUL_W=mul_w, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=group_m, A_MAP=a_map is not None, C_MAP=c_map is not None, STAGES=STAGES,
        **layouts(bm, bn, bk, warps), num_warps=warps,
    )  # fmt: skip
