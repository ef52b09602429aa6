"""The W4A16 grouped GEMM's prefill tiles in Gluon (Hopper) with the decoded weights as the wgmma's
register operand: no decoded tile goes through shared memory.

``gluon_w4a16._w4a16_wgmma_kernel`` computes C = X · Wᵀ with the activations X as the wgmma's A
operand and the decoded weights as its B, which wgmma reads only from shared memory: each K step's
decoded gate and up tiles (32 KB at its 8k tiles) are stored, fenced and waited for by a CTA
barrier before the multiply. Here the product is turned over, Cᵀ = W · Xᵀ: the weights are the A
operand, which wgmma takes from registers, and the activations, copied unchanged, the B operand
from shared memory. Each thread decodes exactly the elements its fragment of A holds
(``DotOperandLayout``, k_width 2: per 16-input block, rows g and g+8 of its warp's 16, inputs
2t, 2t+1, 2t+8, 2t+9 for lane 4g + t), that is code bytes t and t+4 of each of its rows' 8-byte
blocks: ``CODES`` loads them from the step's shared copy in exactly that order, the table decode
(``LUT_PAIR``) turns each byte into its bf16 pair times the block's scale, and the result is the
operand in place (``convert_layout(..., assert_trivial=True)``: no data moves).

    (before the loop: step 0's copies waited for and decoded into registers)
    step i:  issue step i's wgmmas (async) on its decoded weights and its activations' slot
             while they run: wait for step i+1's copies (cp.async into STAGES slots: the
             activations [BT, BK], the gate and up rows' codes [BF, BK/2] and scales), barrier;
             issue the copies of step i+STAGES-1 into step i-1's slot; decode step i+1 into
             other registers
             wait for step i's wgmmas (they read their register operand asynchronously: step
             i's registers stay live to this wait)

A program owns BLOCK_N features (the wgmma's M, 16 a warp) and BLOCK_M sorted pairs (its N: any
multiple of 8 up to 256), as the tiles of ``gluon_w4a16`` and ``triton_moe`` (BLOCK_M is the pairs'
tile the routing is aligned to). Values: ``triton_w4a16``'s (the same e2m1 · scale products in bf16,
fp32 accumulation, the rows' globals, SwiGLU and the routing weight after the loop); the bits may
differ from the other kernels' by the wgmma's K order.

NOT yet run on a GPU (written 2026-12-04; compiled for sm_90 with Triton 3.6). Off (``REGA``,
FT_W4A16_GLUON_REGA=1 with FT_W4A16_GLUON=1) until tests/nvfp4/test_w4a16_gpu.py -k gluon passes
with it and w4a16_timings.py times it faster than the one-partition kernel.
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ft.layers.gluon_sync import cta_barrier
from ft.moe.kernels import triton_moe
from ft.moe.kernels.fp4_decode import lut_asm, lut_scale
from ft.moe.kernels.gluon_w4a16 import banks_fit, copy_weights, pair_rows, run, weight_ptrs
from ft.moe.kernels.triton_moe import pair_tile
from ft.quant.nvfp4 import NVFP4Tensor

REGA = os.environ.get("FT_W4A16_GLUON_REGA", "0") == "1"
STAGES = 4  # copy slots (cp.async groups in flight: STAGES - 2 while a step decodes)
# its tiles (BLOCK_M pairs, BLOCK_N features = 16 x warps x reps, BLOCK_K, GROUP_M, warps, -), laid
# out as ``triton_moe.CONFIGS``; FT_W4A16_GLUON_REGA_TILES=UP/DOWN sets the last row. Not yet swept.
_UP, _DOWN = (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3)
_SMALL_UP, _SMALL_DOWN = (64, 128, 64, 8, 8, 3), (64, 128, 64, 8, 8, 3)
CONFIGS = triton_moe.configs_from_env(
    {name: [(2048, _SMALL_UP, _SMALL_DOWN), (1 << 62, _UP, _DOWN)] for name in ("default", "E128")},
    "FT_W4A16_GLUON_REGA_TILES",
)

# Two code bytes ($2 and $4, a register each as loaded: the same byte of rows g and g + 8; $3 and $5
# repeat them, one element a nibble) -> their bf16 pairs (low nibble first) times their rows' block
# scales ($6, $7: bf16x2, the scale twice): ``triton_w4a16``'s table decode on a word of the two
LUT_PAIR = gl.constexpr(
    lut_asm(
        "prmt.b32 sel, $2, $4, 0x3340;\nmov.b32 w, sel;", "0x5140", word="w", scale0="$6", scale1="$7"
    ).replace(".reg .b32 ", ".reg .b32 w, ")
)


@gluon.jit
def _issue(a_ptr, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, k0, K, a_s, gc, gs, uc, us, up_codes,
           up_scales, SWIGLU: gl.constexpr):  # fmt: skip
    # one K step's copies, one group: the activations [BT, BK], the gate (and up) rows' codes
    # [BF, BK/2] and block scales [BF, BK/16]
    live = k0 < K
    async_copy.async_copy_global_to_shared(a_s, a_ptr + k0, mask=rmask[:, None] & live)
    copy_weights(
        codes_ptr, scale_ptr, nmask_c, nmask_s, live, k0, gc, gs, uc, us, up_codes, up_scales, SWIGLU
    )
    async_copy.commit_group()


@gluon.jit
def _decode(codes_s, scales_s, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, CODES: gl.constexpr,
            DOT_A: gl.constexpr):  # fmt: skip
    # a step's codes [BF, BK/2] and scales [BF, BK/16] in shared memory -> the wgmma's A operand
    # [BF, BK] bf16 in registers: in CODES each thread holds the bytes (t and t + 4 of every block,
    # of rows g and g + 8) its fragment of A needs, its scales by broadcast, each byte twice (join:
    # one element for each nibble), in the fragment's register order
    NB: gl.constexpr = BLOCK_K // 16
    codes = codes_s.reshape([BLOCK_N, NB, 8]).load(CODES)
    s = lut_scale(scales_s.load(gl.SliceLayout(2, CODES)))
    s, codes = gl.broadcast(gl.expand_dims(s, 2), codes)
    codes = codes.to(gl.int32)  # (a register a byte, as loaded)
    pairs = [gl.join(codes, codes), gl.join(s, s)]  # [BF, BK/16, 8, 2]: a byte (and its scale) a nibble
    w = gl.inline_asm_elementwise(LUT_PAIR, "=r,=r,r,r,r,r,r,r", pairs, gl.bfloat16, True, 4)
    return gl.convert_layout(gl.reshape(w, [BLOCK_N, BLOCK_K]), DOT_A, assert_trivial=True)


# a call's pair count, where its weights and row maps start (slices of a batch's): one variant for
# all, as ``gluon_w4a16._w4a16_wgmma_kernel``
@gluon.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _w4a16_rega_kernel(
    a, b, b_scale, b_global, c, topk_w, sorted_ids, block_expert, num_padded,
    EM, N, K, num_pairs, s_am, s_be, s_bn, s_seu, s_snu, s_ge, s_cm, a_map, c_map,
    TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr, SWIGLU: gl.constexpr, MUL_W: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    A_MAP: gl.constexpr, C_MAP: gl.constexpr, STAGES: gl.constexpr,
    MMA: gl.constexpr, DOT_A: gl.constexpr, CODES: gl.constexpr, IO: gl.constexpr, CODES_IO: gl.constexpr,
    SCALES_IO: gl.constexpr, A_SMEM: gl.constexpr, PLAIN: gl.constexpr, CODES_SMEM: gl.constexpr,
    SCALE_UNIT: gl.constexpr = 16,
):  # fmt: skip
    HK: gl.constexpr = BLOCK_K // 2
    NB: gl.constexpr = BLOCK_K // 16
    pid_m, pid_n = pair_tile(gl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(num_padded):
        return
    e = gl.load(block_expert + pid_m).to(gl.int64)
    # the tile's pairs and the input rows they read; the gate rows' codes and scales at k = 0
    # (features past N copy zeros), the up rows N rows below
    a_rows, rmask = pair_rows(sorted_ids, a_map, pid_m, num_pairs, TOPK, A_PER_TOKEN, A_MAP, BLOCK_M, IO)
    a_ptr = (
        a + a_rows[:, None].to(gl.int64) * s_am + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, IO))[None, :]
    )
    codes_ptr, scale_ptr, nmask_c, nmask_s = weight_ptrs(
        b, b_scale, e, pid_n, N, s_be, s_bn, s_seu, s_snu, SCALE_UNIT, BLOCK_N, BLOCK_K, CODES_IO, SCALES_IO
    )
    up_codes = N * s_bn
    up_scales = N * (s_snu * SCALE_UNIT)

    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], A_SMEM)
    gc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HK], CODES_SMEM)
    gs_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NB], PLAIN)
    uc_s = gc_s  # (unused without SwiGLU)
    us_s = gs_s
    if SWIGLU:
        uc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HK], CODES_SMEM)
        us_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NB], PLAIN)

    steps = K // BLOCK_K
    gl.assume(steps >= STAGES - 1)  # (the launcher's check) no path around the loop to its waits
    for s in gl.static_range(STAGES - 1):  # the first steps' copies
        _issue(a_ptr, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, s * BLOCK_K, K, a_s.index(s),
               gc_s.index(s), gs_s.index(s), uc_s.index(s), us_s.index(s), up_codes, up_scales,
               SWIGLU)  # fmt: skip
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)  # Cᵀ: features x pairs
    acc_up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    async_copy.wait_group(STAGES - 2)  # step 0's copies have landed (this thread's)
    fence_async_shared()  # ... before the wgmmas (the async proxy) read them
    cta_barrier()  # ... and every thread's
    w_gate = _decode(gc_s.index(0), gs_s.index(0), BLOCK_N, BLOCK_K, CODES, DOT_A)
    w_up = w_gate  # (unused without SwiGLU)
    if SWIGLU:
        w_up = _decode(uc_s.index(0), us_s.index(0), BLOCK_N, BLOCK_K, CODES, DOT_A)
    for i in range(steps):
        # step i's wgmmas, on its decoded weights (registers) and activations (its slot)
        x_t = a_s.index(i % STAGES).permute((1, 0))  # [BK, BT]
        acc = warpgroup_mma(w_gate, x_t, acc, is_async=True)
        if SWIGLU:
            acc_up = warpgroup_mma(w_up, x_t, acc_up, is_async=True)
        # while they run: step i+1's copies have landed, every thread's, and every warpgroup has
        # waited for step i-1's wgmmas (last step's end), so step i-1's slot takes the copies of
        # step i+STAGES-1; step i+1 decoded into other registers (step i's are still being read)
        async_copy.wait_group(STAGES - 3)
        fence_async_shared()
        cta_barrier()
        prv = (i + STAGES - 1) % STAGES
        _issue(a_ptr, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, (i + STAGES - 1) * BLOCK_K, K,
               a_s.index(prv), gc_s.index(prv), gs_s.index(prv), uc_s.index(prv), us_s.index(prv), up_codes,
               up_scales, SWIGLU)  # fmt: skip
        nxt = (i + 1) % STAGES  # (past the last step: a slot of masked copies, decoded unused)
        g_next = _decode(gc_s.index(nxt), gs_s.index(nxt), BLOCK_N, BLOCK_K, CODES, DOT_A)
        u_next = g_next
        if SWIGLU:
            u_next = _decode(uc_s.index(nxt), us_s.index(nxt), BLOCK_N, BLOCK_K, CODES, DOT_A)
            # step i's wgmmas done: their operand registers (kept live to here) may be reused
            acc, acc_up, w_gate, w_up = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc, acc_up, w_gate, w_up)
            )
        else:
            acc, w_gate = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_gate))
        w_gate = g_next
        w_up = u_next
    async_copy.wait_group(0)

    # in the accumulators' layout (features x pairs): the rows' globals, SwiGLU, the routing weight
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    nmask = n < N
    g_ptr = b_global + e * s_ge + n
    acc = acc * gl.load(g_ptr, mask=nmask, other=0.0)[:, None]
    if SWIGLU:
        acc_up = acc_up * gl.load(g_ptr + N, mask=nmask, other=0.0)[:, None]
        acc = acc / (1.0 + gl.exp(-acc)) * acc_up
    out_rows = gl.load(sorted_ids + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA)))
    omask = out_rows < num_pairs
    if MUL_W:
        acc = acc * gl.load(topk_w + out_rows, mask=omask, other=0.0).to(gl.float32)[None, :]
    if C_MAP:
        out_rows = gl.load(c_map + out_rows, mask=omask, other=0)
    c_ptr = c + out_rows[None, :].to(gl.int64) * s_cm + n[:, None]
    gl.store(c_ptr, acc.to(c.dtype.element_ty), mask=nmask[:, None] & omask[None, :])


def supports(w13: NVFP4Tensor, w2: NVFP4Tensor, x: torch.Tensor | None = None) -> bool:
    """Whether banks gate/up ``w13`` and down ``w2`` (and activations ``x``) fit the kernel (else
    another runs): K (H, then I) a multiple of every row's BLOCK_K with at least STAGES - 1 steps;
    16-byte copies of activation and code rows and 4-byte copies of scale rows, so tensors' starts
    16-byte aligned and code strides multiples of 16 bytes, scale strides of 4."""
    return banks_fit(w13, w2, x, CONFIGS, STAGES, x_rows=8, scale_rows=4)


def layouts(block_m: int, block_n: int, block_k: int, warps: int) -> dict:
    """The kernel's layouts for its tiles (constexpr arguments): the accumulators' (features x
    pairs: 16 features a warp, BLOCK_M pairs an instruction) and the A operand's; CODES, which
    holds the A fragment's code bytes [BF, BK/16, 8] in the fragment's register order; the copies'
    (activations and codes 16 bytes a thread, a row's scales at once); the plain shared layout of
    codes and scales, the activations' MMA swizzle."""
    rows_per_rep = 16 * warps
    assert block_n % rows_per_rep == 0, f"BLOCK_N {block_n} is not a multiple of 16 x warps ({warps})"
    assert block_k in (64, 128) and block_m % 8 == 0 and block_m <= 256, (block_m, block_k)
    nb = block_k // 16
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])
    # registers: row + 8, byte + 4 (the fragment's inputs 2t + 8), the blocks, the row repeats;
    # lanes: byte + 1, + 2 (t), rows + 1, + 2, + 4 (g); warps: rows + 16 ...
    regs = [[8, 0, 0], [0, 0, 4]] + [[0, 1 << i, 0] for i in range(nb.bit_length() - 1)]
    regs += [[rows_per_rep << i, 0, 0] for i in range((block_n // rows_per_rep).bit_length() - 1)]
    codes = gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)],
        block_bases=[],
        shape=[block_n, nb, 8],
    )
    hk = block_k // 2
    return dict(
        MMA=mma,
        DOT_A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        CODES=codes,
        IO=gl.BlockedLayout([1, 8], [256 // block_k, block_k // 8], [warps, 1], [1, 0]),
        CODES_IO=gl.BlockedLayout([1, 16], [512 // hk, hk // 16], [warps, 1], [1, 0]),
        SCALES_IO=gl.BlockedLayout([1, nb], [32, 1], [warps, 1], [1, 0]),
        PLAIN=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        # the codes' 16-byte chunks swapped between the rows of one 128-byte line and the next: a
        # warp's byte loads (rows g = 0..7, one word each) then fall in eight banks, not four twice
        CODES_SMEM=gl.SwizzledSharedLayout(16, 128 // hk, hk // 16, [1, 0]),
        A_SMEM=gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16),
    )


def launch(a, w: NVFP4Tensor, c, topk_w, align, num_pairs, n, k, topk, a_per_token, swiglu, mul_w, cfg,
           a_map=None, c_map=None):  # fmt: skip
    """``triton_w4a16._launch``'s contract (cfg = BLOCK_M pairs, BLOCK_N features, BLOCK_K, GROUP_M,
    warps, stages; the copy slots are ``STAGES``, not the config's stages)."""
    lay = layouts(*cfg[:3], cfg[4])
    run(_w4a16_rega_kernel, lay, STAGES, a, w, c, topk_w, align, num_pairs, n, k, topk, a_per_token, swiglu,
        mul_w, cfg, a_map, c_map)  # fmt: skip
