"""The W4A16 grouped GEMM's prefill tiles in Gluon, warp-specialised (Hopper): ``gluon_w4a16``'s
kernel with its copies and decode in a producer partition of their own.

``gluon_w4a16._w4a16_wgmma_kernel`` runs one partition: the same warps copy, decode and issue the
wgmmas, and under Nsight Compute (H200, 2026-12-04, docs/benchmarks.md) its 8k gate/up launch runs
one program an SM whose 8 warps stall in turn on barriers, loads and the table decode (12.5%
occupancy, a third of the SMs' issue rate), 2-5% faster than the Triton kernel. Here
(``gl.warp_specialize``):

    producer (PRODUCER_WARPS warps, setmaxnreg PRODUCER_REGS): step i's copies landed (cp.async,
        issued two steps ahead) -> decode step i into slot i % STAGES -> fence, arrive full[slot]
        -> wait until the wgmma warpgroups release step i-1's slot (empty) -> copies of step
        i + STAGES - 1 into it
    wgmma warpgroups (the launch's warps, the rest of the registers): wait full[slot] -> step i's
        wgmmas (async) -> wait until only they are in flight -> release step i-1's slot (empty)

A slot holds a step's activations, codes, scales and decoded tiles. The arithmetic, tiles, shared
helpers and epilogue are ``gluon_w4a16``'s (``_operands``, ``_issue_step``, ``_decode``,
``_epilogue``), so the output should be that kernel's bit for bit.

Run on an H200 on 2026-12-04 18:08 (docs/benchmarks.md): its GPU tests pass
(tests/nvfp4/test_w4a16_gpu.py -k gluon, bit for bit the Triton kernel's), but the MoE call is
26-48% SLOWER than the one-partition kernel at 1k-16k tokens (8k: 3,714 against 2,958 us). Off
(``WS``). Our reading, not profiled: one producer warpgroup decodes every code of a step (twice
the table-decode instructions a thread of the eight-warp kernel), a warp a scheduler with nothing
to hide its shared-memory reads, and the wgmmas wait on it. A producer of two warpgroups, or
the decoded weights as the wgmma's register operand (no decoded tile in shared memory), are what
is left to try. Compiled for sm_90 with Triton 3.6: gate/up at the 8k tiles producer 96
registers, wgmma warps 200, 175 KB shared, no spills.
"""

from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ft.layers.gluon_sync import cta_barrier
from ft.moe.kernels.gluon_w4a16 import _decode, _epilogue, _issue_step, _operands, layouts
from ft.moe.kernels.triton_moe import pair_tile

# in place of ``gluon_w4a16._w4a16_wgmma_kernel`` when on (FT_W4A16_GLUON_WS=1, with
# ``triton_w4a16.GLUON`` on); the producer's warps and registers (Triton gives the wgmma
# warpgroups the rest: 200 a thread at the 8k gate/up tiles)
WS = os.environ.get("FT_W4A16_GLUON_WS", "0") == "1"
PRODUCER_WARPS = 4
PRODUCER_REGS = 96


def ws_layouts(block_m: int, block_n: int, block_k: int, warps: int) -> dict:
    """``layouts`` for ``_w4a16_ws_kernel``: the MMA and shared layouts for the launch's ``warps``, the
    copies' and the decode's for the producer's ``PRODUCER_WARPS``."""
    consumer = layouts(block_m, block_n, block_k, warps)
    producer = layouts(16 * PRODUCER_WARPS, block_n, block_k, PRODUCER_WARPS)
    return {**consumer, **{k: producer[k] for k in ("IO", "CODES", "SCALES", "P3", "B2")}}


@gluon.jit
def _ws_consume(a0_s, a1_s, ga_s, gb_s, ua_s, ub_s, full, empty, steps, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SWIGLU: gl.constexpr,
                MMA: gl.constexpr):  # fmt: skip
    # the default partition (the wgmma warpgroups): step i's MMAs once its slot is full; step i-1's
    # slot back to the producer once its MMAs are done (this step's stay in flight)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(full.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(a0_s.index(slot), ga_s.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a1_s.index(slot), gb_s.index(slot).permute((1, 0)), acc, is_async=True)
        if SWIGLU:
            acc_up = warpgroup_mma(a0_s.index(slot), ua_s.index(slot).permute((1, 0)), acc_up, is_async=True)
            acc_up = warpgroup_mma(a1_s.index(slot), ub_s.index(slot).permute((1, 0)), acc_up, is_async=True)
            acc, acc_up = warpgroup_mma_wait(num_outstanding=4, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
        # (an arrive is the partition's barrier, then one thread's arrival: both warpgroups are past)
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    if SWIGLU:
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, acc_up


@gluon.jit
def _ws_produce(a, b, b_scale, sorted_ids, a_map, e, pid_m, pid_n, N, K, num_pairs, s_am, s_be, s_bn, s_se,
                s_sn,
                a0_s, a1_s, gc_s, gs_s, uc_s, us_s, ga_s, gb_s, ua_s, ub_s, full, empty, steps,
                TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr, A_MAP: gl.constexpr, SWIGLU: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                IO: gl.constexpr, CODES: gl.constexpr, SCALES: gl.constexpr, P3: gl.constexpr,
                B2: gl.constexpr):  # fmt: skip
    # the worker partition (its own warps and layouts): step i's decode from its landed codes into its
    # slot, fenced for the wgmmas and signalled on full[i % STAGES]; then the copies of step
    # i + STAGES - 1 into step i-1's slot once the consumers release it (they do after issuing step
    # i's MMAs: waiting for that before this decode would deadlock)
    HK: gl.constexpr = BLOCK_K // 2
    a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s = _operands(
        a, b, b_scale, sorted_ids, a_map, e, pid_m, pid_n, N, num_pairs, s_am, s_be, s_bn, s_se, s_sn, TOPK,
        A_PER_TOKEN, A_MAP, BLOCK_M, BLOCK_N, BLOCK_K, IO, CODES, SCALES)  # fmt: skip
    up_codes = N * s_bn
    up_scales = N * s_sn
    for t in gl.static_range(STAGES - 1):  # every slot starts free
        _issue_step(a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, t * BLOCK_K, K, a0_s.index(t),
                    a1_s.index(t), gc_s.index(t), gs_s.index(t), uc_s.index(t), us_s.index(t), up_codes,
                    up_scales, SWIGLU)  # fmt: skip
    for i in range(steps):
        slot = i % STAGES
        async_copy.wait_group(STAGES - 2)  # step i's copies (this thread's) have landed
        cta_barrier()  # ... and every producer thread's (the partition's barrier)
        wa, wb = _decode(gc_s.index(slot), gs_s.index(slot), BLOCK_N, HK, P3, B2)
        ga_s.index(slot).store(wa)
        gb_s.index(slot).store(wb)
        if SWIGLU:
            ua, ub = _decode(uc_s.index(slot), us_s.index(slot), BLOCK_N, HK, P3, B2)
            ua_s.index(slot).store(ua)
            ub_s.index(slot).store(ub)
        fence_async_shared()  # the decoded tiles and the landed activations, for the wgmmas
        mbarrier.arrive(full.index(slot))
        nxt = i + STAGES - 1
        nslot = nxt % STAGES  # step i-1's slot (free from the start for the first STAGES - 1 steps)
        mbarrier.wait(empty.index(nslot), ((nxt // STAGES) & 1) ^ 1, pred=nxt >= STAGES)
        _issue_step(a_ptr0, rmask, codes_ptr, scale_ptr, nmask_c, nmask_s, nxt * BLOCK_K, K,
                    a0_s.index(nslot), a1_s.index(nslot), gc_s.index(nslot), gs_s.index(nslot),
                    uc_s.index(nslot), us_s.index(nslot), up_codes, up_scales, SWIGLU)  # fmt: skip
    async_copy.wait_group(0)


@gluon.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _w4a16_ws_kernel(
    a, b, b_scale, b_global, c, topk_w, sorted_ids, block_expert, num_padded,
    EM, N, K, num_pairs, s_am, s_be, s_bn, s_se, s_sn, s_ge, s_cm, a_map, c_map,
    TOPK: gl.constexpr, A_PER_TOKEN: gl.constexpr, SWIGLU: gl.constexpr, MUL_W: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    A_MAP: gl.constexpr, C_MAP: gl.constexpr, STAGES: gl.constexpr,
    MMA: gl.constexpr, IO: gl.constexpr, A_SMEM: gl.constexpr, B_SMEM: gl.constexpr,
    CODES: gl.constexpr, SCALES: gl.constexpr, PLAIN: gl.constexpr, P3: gl.constexpr, B2: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    # ``_w4a16_wgmma_kernel``'s contract and arithmetic with the copies and the decode in warps of their
    # own (IO, CODES, SCALES, P3 and B2 laid out for PRODUCER_WARPS; MMA for the launch's warps)
    HK: gl.constexpr = BLOCK_K // 2
    NB: gl.constexpr = BLOCK_K // 16
    pid_m, pid_n = pair_tile(gl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(num_padded):
        return
    e = gl.load(block_expert + pid_m).to(gl.int64)
    # a slot a step: its activations, codes and scales (copied) and its decoded tiles
    a0_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HK], A_SMEM)
    a1_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HK], A_SMEM)
    gc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HK], PLAIN)
    gs_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NB], PLAIN)
    ga_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HK], B_SMEM)
    gb_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HK], B_SMEM)
    uc_s = gc_s  # (unused without SwiGLU)
    us_s = gs_s
    ua_s = ga_s
    ub_s = gb_s
    if SWIGLU:
        uc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HK], PLAIN)
        us_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, NB], PLAIN)
        ua_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HK], B_SMEM)
        ub_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HK], B_SMEM)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):  # one arrival a phase: a partition arrives through one thread
        mbarrier.init(full.index(t), count=1)
        mbarrier.init(empty.index(t), count=1)
    steps = K // BLOCK_K
    acc, acc_up = gl.warp_specialize(
        (
            (_ws_consume, (a0_s, a1_s, ga_s, gb_s, ua_s, ub_s, full, empty, steps, BLOCK_M, BLOCK_N, STAGES,
                           SWIGLU, MMA)),
            (_ws_produce, (a, b, b_scale, sorted_ids, a_map, e, pid_m, pid_n, N, K, num_pairs, s_am, s_be,
                           s_bn, s_se, s_sn, a0_s, a1_s, gc_s, gs_s, uc_s, us_s, ga_s, gb_s, ua_s, ub_s, full,
                           empty, steps, TOPK, A_PER_TOKEN, A_MAP, SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                           IO, CODES, SCALES, P3, B2)),
        ),
        (PRODUCER_WARPS,),
        (PRODUCER_REGS,),
    )  # fmt: skip
    _epilogue(acc, acc_up, b_global, c, topk_w, sorted_ids, c_map, e, pid_m, pid_n, N, num_pairs, s_ge, s_cm,
              SWIGLU, MUL_W, C_MAP, BLOCK_M, BLOCK_N, MMA)  # fmt: skip
