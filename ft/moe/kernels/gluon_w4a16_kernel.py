"""The W4A16 grouped GEMM's prefill tiles in Gluon (Hopper), with decoding overlapped with the MMAs.

``triton_w4a16_kernel._w4a16_gemm_kernel`` decodes a K step's codes in registers and stores them to
shared memory for ``tl.dot``; Triton then waits for every wgmma group before the next step's
decoded tile overwrites that buffer (``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each dot, SASS for
sm_90, 2026-12-04), so decoding and MMA never overlap: at an 8k chunk the gate/up launch runs at
140 TFLOP/s with 255 registers and one program an SM (Nsight Compute, docs/benchmarks.md). Here the
loop is written out (Gluon: explicit layouts, shared memory and wgmma groups):

    step i:  wait for step i's copies (cp.async, STAGES slots, issued STAGES-1 steps ahead: the
             activations' two halves, the packed codes and the block scales), barrier
             decode step i from shared memory by the PTX byte tables (``fp4_decode.LUT_LO/HI``,
             a thread one 16-input block: one scale) while step i-1's wgmmas run, store it to
             decoded buffer i % 2 (two buffers)
             fence, barrier, issue step i's wgmmas (async), wait until only they are in flight,
             barrier (every warpgroup is past step i-1: its slot and buffer are free), issue the
             copies of step i+STAGES-1 into step i-1's slot

The arithmetic is ``triton_w4a16``'s LUT path: per K step of BLOCK_K inputs two half-K products
(the activations read in the table decode's order, ``ka``), fp32 accumulators, the rows'
globals, SwiGLU and the routing weight applied after the loop, the same pairs' rows and padding
(``align_by_expert``). The bits may differ from the Triton kernel's (wgmma's K order within a
step), the values agree to fp32 accumulation. Not here: its tiles, the calls it takes, its
layouts, its launch and how it fared on an H200 (``gluon_w4a16``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ft.layers.gluon_sync import cta_barrier
from ft.moe.kernels import fp4_decode
from ft.moe.kernels.fp4_decode import lut_scale
from ft.moe.kernels.grouped_tiles import pair_tile, store_pairs

LUT_LO = gl.constexpr(fp4_decode.LUT_LO.value)
LUT_HI = gl.constexpr(fp4_decode.LUT_HI.value)
# the bytes a scale stride counts in (``gluon_w4a16.supports``: multiples of 16)
SCALE_UNIT = gl.constexpr(16)


@gluon.jit
def _issue_step(a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, k0, K, a0, a1, gc, gs, uc, us,
                up_codes, up_scales, SWIGLU: gl.constexpr):  # fmt: skip
    # one K step's copies, one group: the activations' two halves (columns ka and ka + 4), the gate
    # (and up) rows' packed codes [BN, BK/2] and block scales [BN, BK/16]
    live = k0 < K
    mask_a = rmask[:, None] & live
    async_copy.async_copy_global_to_shared(a0, a_ptr0 + k0, mask=mask_a)
    async_copy.async_copy_global_to_shared(a1, a_ptr0 + (k0 + 4), mask=mask_a)
    copy_weights(
        codes_ptr, scale_ptr, nmask_c, nmask_s, live, k0, gc, gs, uc, us, up_codes, up_scales, SWIGLU
    )
    async_copy.commit_group()


@gluon.jit
def copy_weights(codes_ptr, scale_ptr, nmask_c, nmask_s, live, k0, gc, gs, uc, us, up_codes, up_scales,
                 SWIGLU: gl.constexpr):  # fmt: skip
    # a K step's copies of the gate (and up) rows' packed codes [BN, BK/2] and block scales
    # [BN, BK/16] (not committed: the caller's group)
    mask_c = nmask_c[:, None] & live
    mask_s = nmask_s[:, None] & live
    async_copy.async_copy_global_to_shared(gc, codes_ptr + k0 // 2, mask=mask_c)
    async_copy.async_copy_global_to_shared(gs, scale_ptr + k0 // 16, mask=mask_s)
    if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
        async_copy.async_copy_global_to_shared(uc, codes_ptr + (up_codes + k0 // 2), mask=mask_c)
        async_copy.async_copy_global_to_shared(us, scale_ptr + (up_scales + k0 // 16), mask=mask_s)


@gluon.jit
def _decode(codes_s, scales_s, BLOCK_N: gl.constexpr, HK: gl.constexpr, P3: gl.constexpr, B2: gl.constexpr):
    # a step's codes [BN, BK/2] and scales [BN, BK/16] from shared memory -> ``fp4_decode.
    # decode_lut``'s halves (wa: inputs 8q + i, wb: 8q + 4 + i at position 4q + i), [BN, BK/2] bf16.
    # In P3 a thread holds one 16-input block's 8 bytes, so its scale is one element broadcast
    codes = codes_s.reshape([BLOCK_N, HK // 8, 8]).load(P3)
    s = lut_scale(scales_s.load(gl.SliceLayout(2, P3)))
    s, codes = gl.broadcast(gl.expand_dims(s, 2), codes)
    wa = gl.inline_asm_elementwise(LUT_LO, "=r,=r,r,r,r", [codes, s], gl.bfloat16, True, 4)
    wb = gl.inline_asm_elementwise(LUT_HI, "=r,=r,r,r,r", [codes, s], gl.bfloat16, True, 4)
    wa = gl.convert_layout(gl.reshape(wa, [BLOCK_N, HK]), B2, assert_trivial=True)
    wb = gl.convert_layout(gl.reshape(wb, [BLOCK_N, HK]), B2, assert_trivial=True)
    return wa, wb


@gluon.jit
def _operands(a, b, b_scale, sorted_ids, a_map, e, pid_m, pid_n, N, num_pairs, s_am, s_be, s_bn, s_seu, s_snu,
              TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr, A_MAP: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, IO: gl.constexpr,
              CODES: gl.constexpr, SCALES: gl.constexpr):  # fmt: skip
    # the activations' pointers in the table decode's input order (``ka``), their rows' mask, and
    # ``weight_ptrs``: the pointers and masks of ``_issue_step``
    HK: gl.constexpr = BLOCK_K // 2
    a_rows, rmask = pair_rows(sorted_ids, a_map, pid_m, num_pairs, TOPK, A_PER_TOKEN, A_MAP, BLOCK_M, IO)
    kh = gl.arange(0, HK, layout=gl.SliceLayout(0, IO))
    ka = (kh // 4) * 8 + kh % 4  # the table decode's inputs (wa's; wb's are 4 further)
    a_ptr0 = a + a_rows[:, None].to(gl.int64) * s_am + ka[None, :]
    codes_ptr, scale_ptr, nmask_c, nmask_s = weight_ptrs(
        b, b_scale, e, pid_n, N, s_be, s_bn, s_seu, s_snu, BLOCK_N, BLOCK_K, CODES, SCALES
    )
    return a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s


@gluon.jit
def pair_rows(sorted_ids, a_map, pid_m, num_pairs, TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr,
              A_MAP: gl.constexpr, BLOCK_M: gl.constexpr, IO: gl.constexpr):  # fmt: skip
    # the tile's pairs -> the input rows they read (``grouped_tiles.tile_pairs``) in IO's rows, and
    # which are pairs (not padding)
    rows = gl.load(sorted_ids + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, IO)))
    rmask = rows < num_pairs
    a_rows = (rows // TOPK) if A_PER_TOKEN else rows
    if A_MAP:
        a_rows = gl.load(a_map + a_rows, mask=rmask, other=0)
    return a_rows, rmask


@gluon.jit
def weight_ptrs(b, b_scale, e, pid_n, N, s_be, s_bn, s_seu, s_snu, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, CODES: gl.constexpr, SCALES: gl.constexpr):  # fmt: skip
    # the gate rows' packed codes [BN, BK/2] and block scales [BN, BK/16] at k = 0 (the up rows sit N
    # rows below, same expert) in the copies' layouts, and which rows are features (< N). The scales'
    # strides come in units of ``SCALE_UNIT`` bytes, so the compiler knows their rows' copies 16-byte
    # aligned (a byte stride a launch could not show a multiple of 16 made them 1-byte cp.async
    # copies, which do not exist: a removed kernel's banks failed to compile so, an H200, 2026-12-05)
    n_c = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODES))
    codes_ptr = b + e * s_be + n_c[:, None].to(gl.int64) * s_bn
    codes_ptr += gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, CODES))[None, :]
    n_s = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALES))
    scale_ptr = b_scale + e * (s_seu * SCALE_UNIT) + n_s[:, None].to(gl.int64) * (s_snu * SCALE_UNIT)
    scale_ptr += gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, SCALES))[None, :]
    return codes_ptr, scale_ptr, n_c < N, n_s < N


# a call's pair count, where its weights and row maps start (slices of a batch's): one variant for
# all, as ``triton_w4a16_kernel._w4a16_gemm_kernel``
@gluon.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _w4a16_wgmma_kernel(
    a, b, b_scale, b_global, c, topk_w, sorted_ids, block_expert, num_padded,
    EM, N, K, num_pairs, s_am, s_be, s_bn, s_seu, s_snu, s_ge, s_cm, a_map, c_map,
    TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr, SWIGLU: gl.constexpr, MUL_W: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    A_MAP: gl.constexpr, C_MAP: gl.constexpr, STAGES: gl.constexpr,
    MMA: gl.constexpr, IO: gl.constexpr, A_SMEM: gl.constexpr, B_SMEM: gl.constexpr,
    CODES: gl.constexpr, SCALES: gl.constexpr, PLAIN: gl.constexpr, P3: gl.constexpr, B2: gl.constexpr,
):  # fmt: skip
    HK: gl.constexpr = BLOCK_K // 2
    NB: gl.constexpr = BLOCK_K // 16  # scale blocks a step
    # the program's tile (GROUP_M row blocks take each column block in turn)
    pid_m, pid_n = pair_tile(gl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(num_padded):
        return
    e = gl.load(block_expert + pid_m).to(gl.int64)
    a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s = _operands(
        a, b, b_scale, sorted_ids, a_map, e, pid_m, pid_n, N, num_pairs, s_am, s_be, s_bn, s_seu, s_snu,
        TOPK, A_PER_TOKEN, A_MAP, BLOCK_M, BLOCK_N, BLOCK_K, IO, CODES, SCALES)  # fmt: skip
    up_codes = N * s_bn
    up_scales = N * (s_snu * SCALE_UNIT)

    # STAGES steps of copies (activations, codes, scales), two decoded tiles of gate (and up)
    a0_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HK], A_SMEM)
    a1_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HK], A_SMEM)
    gc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HK], PLAIN)
    gs_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NB], PLAIN)
    ga_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)
    gb_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)
    uc_s = gc_s  # (unused without SwiGLU)
    us_s = gs_s
    if SWIGLU:
        uc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HK], PLAIN)
        us_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NB], PLAIN)
        ua_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)
        ub_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HK], B_SMEM)

    steps = K // BLOCK_K
    gl.assume(steps >= STAGES - 1)  # (the launcher's check) no path around the loop to its waits
    for s in gl.static_range(STAGES - 1):  # the first steps' copies
        _issue_step(a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, s * BLOCK_K, K, a0_s.index(s),
                    a1_s.index(s), gc_s.index(s), gs_s.index(s), uc_s.index(s), us_s.index(s), up_codes,
                    up_scales, SWIGLU)  # fmt: skip
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    for i in range(steps):
        buf = i % 2
        slot = i % STAGES
        async_copy.wait_group(STAGES - 2)  # this step's copies have landed (this thread's)
        cta_barrier()  # ... and every thread's
        # this step's decode (step i-1's wgmmas may still run); its buffer was last read by step
        # i-2, which every warpgroup finished before the last step's closing barrier
        wa, wb = _decode(gc_s.index(slot), gs_s.index(slot), BLOCK_N, HK, P3, B2)
        ga_s.index(buf).store(wa)
        gb_s.index(buf).store(wb)
        if SWIGLU:
            ua, ub = _decode(uc_s.index(slot), us_s.index(slot), BLOCK_N, HK, P3, B2)
            ua_s.index(buf).store(ua)
            ub_s.index(buf).store(ub)
        fence_async_shared()
        cta_barrier()  # every decoded tile is stored
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
        cta_barrier()  # every warpgroup is past step i-1: its slot (decoded, multiplied) is free
        nxt = (i + STAGES - 1) % STAGES
        _issue_step(a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, (i + STAGES - 1) * BLOCK_K, K,
                    a0_s.index(nxt), a1_s.index(nxt), gc_s.index(nxt), gs_s.index(nxt), uc_s.index(nxt),
                    us_s.index(nxt), up_codes, up_scales, SWIGLU)  # fmt: skip
    if SWIGLU:
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    _epilogue(acc, acc_up, b_global, c, topk_w, sorted_ids, c_map, e, pid_m, pid_n, N, num_pairs, s_ge, s_cm,
              SWIGLU, MUL_W, C_MAP, BLOCK_M, BLOCK_N, MMA)  # fmt: skip


@gluon.jit
def _epilogue(acc, acc_up, b_global, c, topk_w, sorted_ids, c_map, e, pid_m, pid_n, N, num_pairs, s_ge, s_cm,
              SWIGLU: gl.constexpr, MUL_W: gl.constexpr, C_MAP: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, MMA: gl.constexpr):  # fmt: skip
    # in the accumulators' layout: the rows' globals, SwiGLU, the routing weight, the pairs' rows
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    nmask = n < N
    g_ptr = b_global + e * s_ge + n
    acc = acc * gl.load(g_ptr, mask=nmask, other=0.0)[None, :]
    if SWIGLU:
        acc_up = acc_up * gl.load(g_ptr + N, mask=nmask, other=0.0)[None, :]
        acc = acc / (1.0 + gl.exp(-acc)) * acc_up
    out_rows = gl.load(sorted_ids + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA)))
    omask = out_rows < num_pairs
    store_pairs(acc, c, topk_w, out_rows, omask, n, nmask, s_cm, c_map, MUL_W, C_MAP)
