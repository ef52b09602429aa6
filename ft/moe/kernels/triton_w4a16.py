"""Fused MoE for NVFP4 expert banks in Triton, W4A16: codes and scales are decoded in registers,
the products run as bf16 MMAs with fp32 accumulation (Hopper has no FP4 tensor cores).

Same contract and structure as ``triton_moe.fused_moe_triton`` (whose token->expert sort and
padding, ``align_by_expert``, and tile table, ``pick_config``, it reuses):

    act = silu(g_gate · (x @ W_gate.T)) * (g_up · (x @ W_up.T))   # [T*k, I], SwiGLU fused
    y   = weights[t, k] · g_down · (act @ W_down.T)               # [T*k, H]
    out = sum_k y                                                 # [T, H]

where ``W = e2m1(code) · scale`` is decoded tile by tile and the per-row fp32 globals ``g`` are
applied to the accumulator, after the dot. The decoding uses integer ops only, no fp8 or fp4
units: an E2M1 code's bits placed into an fp16 exponent/mantissa give ``value · 2^-14`` and an
E4M3 byte's give ``scale · 2^-8``; their fp32 product ``value · scale · 2^-22`` has at most six
significant bits, so it is exact in bf16, and the ``2^22`` is folded into the global. Not here:
fp16 activations (the folded magnitudes underflow fp16), W4A4, expert parallelism.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous
from ft.moe.kernels.into import Into
from ft.moe.kernels.triton_moe import mma_path, pair_tile, store_pairs, tile_pairs
from ft.quant.nvfp4 import BLOCK, NVFP4Tensor

UNFOLD = float(2**22)  # undoes the 2^-14 · 2^-8 of the fp16 bit placement
# The MMA kernel's codes read as 32-bit words of eight and decoded word-wise into bf16 (``_words``):
# codes j and j + 4 of a word, 16 bits apart, placed into the two halves of one 32-bit value (the
# bits of bf16 e2m1 · 2^-126) by two shifts and one and-or, times their block's scale as a bf16
# (scale · 2^104): the same exact bf16 values e2m1 · scale · 2^-22 as ``_decode``, so the same
# bits. The scales come as 32-bit words of four too, which the pipeliner copies ahead with the
# codes (cp.async takes 4 bytes at the least: the byte decode loads its scale bytes inside the
# loop, a memory round trip each step). Compiled for sm_90 at T = 8192's tiles (8 warps, capped at
# 128 registers, ``two_per_sm``) a loop step of the gate/up kernel is 392 SASS instructions against
# the byte decode's 556 (98 PRMT, 90 IMAD, 71 LOP3, 36 SHF, 34 HADD2, 32 FMUL, 16 F2FP: nibbles
# split, widened and converted one by one, for 32 weights a thread beside 8 HGMMA) and its two
# in-loop scale loads; the down kernel's 396 against 520 and one (8 bytes spilled under the cap).
# The NVFP4 prefill is bound by decoding (the 80B's 8k prefill 29.6k tok/s resident, where the link
# would allow ~48k offloaded; docs/benchmarks.md, 2026-12-03). Banks whose scale rows are not
# whole words (K not a multiple of 64, e.g. a TP shard of I = 48) decode bytes. A zero-exponent
# code is a bf16 subnormal (0.5 · 2^-126) the multiply must keep: 1 multiplies in packed bf16, 2
# in fp32 (the bits widened into an fp32's top half, an fp32 multiply, a rounding to bf16: fp32
# subnormals are kept, as the MoE GEMV's words rely on; 435 and 434 instructions), should the
# GPU's bf16 multiply flush them. Off (0) until timed on a GPU (FT_W4A16_WORD_DECODE=1 or 2):
# tests/nvfp4/test_w4a16_gpu.py's bit equality, then tests/nvfp4/w4a16_timings.py and the 8k prefill.
WORD_DECODE = int(os.environ.get("FT_W4A16_WORD_DECODE", "0"))
# The MMA kernel launched capped at the registers that let two programs share an SM (``two_per_sm``),
# whatever its decode: uncapped, the byte decode's down kernel at T = 8192's tiles takes 163
# registers a thread (one 8-warp program an SM), capped 128 with no spills (compiled for sm_90).
# Off until timed (FT_W4A16_TWO_PER_SM=1); the word decode is always capped.
TWO_PER_SM = os.environ.get("FT_W4A16_TWO_PER_SM", "0") == "1"
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's interpreter: CPU tensors, no PTX
# its bf16 arithmetic multiplies bit patterns (triton issue 11584), so there ``_words`` multiplies in fp32
_GPU: tl.constexpr = tl.constexpr(not INTERPRETER)
# Up to this many tokens, ``triton_moe_gemv`` runs instead (no sort, no 16-row MMA padding), as
# timed against this path by tests/nvfp4/w4a16_timings.py on an H200.
# H200, 2026-11-30, 02:50 UTC (tests/gpu/config_sweep.py, with the GEMV's tiles from that sweep):
# 31.4 vs 46.4 us at T=1, 54.2 vs 73.1 at T=2; at T=4 98.5 (another tile) vs 105.5. The GEMV now
# rounds each pair's term as this path does (see triton_moe.GEMV_MAX_TOKENS), so T = 3, 4 could go
# either way; they stay here until timed with the shipped tile.
GEMV_MAX_TOKENS = 2


def takes_gemv(tokens: int, inter: int) -> bool:
    """Whether a call of ``tokens`` tokens (its batch's) takes the GEMV (any ``inter``, as timed)."""
    return 0 < tokens <= GEMV_MAX_TOKENS


@triton.jit
def _decode(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # packed uint8 [BN, BK/2] (element 2i in the low nibble), scale uint8 [BN, BK/16] (e4m3 bits)
    # -> bf16 [BN, BK] holding e2m1 · scale · 2^-22, exactly (at most 6 significant bits)
    return _decode_f32(packed, scale, BLOCK_N, BLOCK_K).to(tl.bfloat16)


@triton.jit
def _decode_f32(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # ``_decode`` in fp32, for callers that multiply in fp32 (the GEMV): the same values, one
    # rounding to bf16 and one widening back fewer per element
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, BLOCK_K])
    s = tl.reshape(tl.broadcast_to(e4m3(scale)[:, :, None], [BLOCK_N, BLOCK_K // 16, 16]), [BLOCK_N, BLOCK_K])
    return e2m1(codes) * s


@triton.jit
def e2m1(codes):
    # 4-bit codes (uint8, any shape) -> fp32 e2m1 values · 2^-14: the code's 3 magnitude bits placed
    # as an fp16's exponent and top mantissa bit, its sign bit as the fp16's
    value = ((codes & 7).to(tl.int16) << 9) | ((codes & 8).to(tl.int16) << 12)
    return value.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3(scale):
    # e4m3 bits (uint8, any shape) -> fp32 values · 2^-8, placed in an fp16 the same way
    s = ((scale & 0x7F).to(tl.int16) << 7) | ((scale & 0x80).to(tl.int16) << 8)
    return s.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _code_bits(words, J: tl.constexpr, MAG: tl.constexpr = 0x01C001C0, SIGN: tl.constexpr = 0x80008000):
    # code J of each 32-bit word (bits 4J..4J+3) as the bits of a bf16 e2m1 · 2^-126 in the low half,
    # and (with the default masks) code J + 4, 16 bits above it, in the high half: three magnitude
    # bits to a bf16's lowest two exponent bits and top mantissa bit (bits 6..8; a zero exponent is a
    # bf16 subnormal, 0.5 · 2^-126 exactly), the sign to bit 15. Two shifts and one and-or
    if 4 * J >= 6:
        mag = (words >> (4 * J - 6)) & MAG
    else:
        mag = (words << (6 - 4 * J)) & MAG
    if 4 * J >= 12:
        sign = (words >> (4 * J - 12)) & SIGN
    else:
        sign = (words << (12 - 4 * J)) & SIGN
    return mag | sign


@triton.jit
def _scaled_pair(words, J: tl.constexpr, s, BF16_MUL: tl.constexpr):
    # codes J and J + 4 of each word (``_code_bits``), each times its scale s (bf16 scale · 2^104):
    # e2m1 · scale · 2^-22, exact
    bits = _code_bits(words, J)
    lo, hi = bits & 0xFFFF, bits >> 16
    if BF16_MUL and _GPU:  # packed bf16 multiplies
        return _bf16(lo) * s, _bf16(hi) * s
    return _fp32_scaled(lo, s), _fp32_scaled(hi, s)


@triton.jit
def _bf16(bits):
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp32_scaled(bits, s):
    # the product in fp32 (the bf16 bits as an fp32's top half), rounded to bf16: WORD_DECODE = 2,
    # and the interpreter's (its bf16 arithmetic and its widening of bf16 subnormals are not the GPU's)
    return ((bits << 16).to(tl.float32, bitcast=True) * s.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _words(words, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_MUL: tl.constexpr = True):
    # words uint32 [BN, BK/8] (code j of word w is element 8w + j), scales uint32 [BN, BK/8] (the
    # word of four e4m3 scales holding word w's, block w/2's: byte (w/2) mod 4) -> bf16 [BN, BK]
    # holding e2m1 · scale · 2^-22, ``_decode``'s values: a product of at most six significant
    # bits, exact in bf16 whatever rounds it
    block = tl.arange(0, BLOCK_K // 8)[None, :] // 2
    scale = ((scales >> (8 * (block % 4))) & 0xFF).to(tl.uint8)
    s = (e4m3(scale) * 2.0**112).to(tl.bfloat16)  # scale · 2^104, exact
    c0, c4 = _scaled_pair(words, 0, s, BF16_MUL)
    c1, c5 = _scaled_pair(words, 1, s, BF16_MUL)
    c2, c6 = _scaled_pair(words, 2, s, BF16_MUL)
    c3, c7 = _scaled_pair(words, 3, s, BF16_MUL)
    # joins add a last axis: pairing codes j and j + 1 last, j and j + 2 before, j and j + 4 first
    # gives each word's eight values in the order j = 0..7
    w = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _tile(b_ptr, s_ptr, bmask, smask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    # a [BN, BK] tile of weights, bf16: from words (``_words``; WORDS 1 or 2, ``WORD_DECODE``) or bytes
    codes = tl.load(b_ptr, mask=bmask, other=0)
    scales = tl.load(s_ptr, mask=smask, other=0)
    if WORDS:
        w = _words(codes, scales, BLOCK_N, BLOCK_K, WORDS == 1)
    else:
        w = _decode(codes, scales, BLOCK_N, BLOCK_K)
    return w


# a call's pair count, where its weights and row maps start (slices of a batch's): one variant for all
@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_w", "a_map", "c_map"])
def _w4a16_gemm_kernel(
    a,
    b,
    b_scale,
    b_global,
    c,
    topk_w,
    sorted_ids,
    block_expert,
    num_padded,
    EM,
    N,
    K,
    num_pairs,
    s_am,
    s_be,
    s_bn,
    s_se,
    s_sn,
    s_ge,
    s_cm,
    unfold,
    a_map,
    c_map,
    TOPK: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_MAP: tl.constexpr = False,
    C_MAP: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
):
    wait_for_previous(USE_PDL)
    # c[rows] = f(g[e] · (a[rows] @ W[e].T)) for one BLOCK_M run of (token, k) pairs sharing expert e
    pid_m, pid_n = pair_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    e, rows, rmask, a_rows, n, nmask = tile_pairs(
        pid_m, pid_n, sorted_ids, block_expert, num_pairs, N, a_map, TOPK, A_PER_TOKEN, BLOCK_M, BLOCK_N,
        A_MAP,
    )  # fmt: skip
    kk = tl.arange(0, BLOCK_K)
    a_ptr = a + a_rows[:, None].to(tl.int64) * s_am + kk[None, :]  # [BM, BK]
    rows_b = b + e * s_be + n[:, None].to(tl.int64) * s_bn  # the rows' codes, bytes
    rows_s = b_scale + e * s_se + n[:, None].to(tl.int64) * s_sn  # their scales
    if WORDS:  # [BN, BK/8] words of codes, the word of four scales each one's block is in (``_words``):
        # 32-bit loads, which the pipeliner copies ahead (a scale byte a thread it loads in the loop)
        kc = tl.arange(0, BLOCK_K // 8)
        b_ptr = rows_b.to(tl.pointer_type(tl.uint32)) + kc[None, :]
        s_ptr = rows_s.to(tl.pointer_type(tl.uint32)) + (kc // 8)[None, :]
        up_b, up_s, step_b, step_s = N * (s_bn // 4), N * (s_sn // 4), BLOCK_K // 8, BLOCK_K // 64
    else:  # [BN, BK/2] packed bytes, [BN, BK/16] scales (``_decode``)
        kc = tl.arange(0, BLOCK_K // 2)
        ks = tl.arange(0, BLOCK_K // 16)
        b_ptr = rows_b + kc[None, :]
        s_ptr = rows_s + ks[None, :]
        up_b, up_s, step_b, step_s = N * s_bn, N * s_sn, BLOCK_K // 2, BLOCK_K // 16
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        bmask = nmask[:, None]
        smask = nmask[:, None]
        if EVEN_K:
            at = tl.load(a_ptr, mask=rmask[:, None], other=0.0)
        else:  # K is a multiple of 16, so whole bytes, words and scale blocks are in or out
            left = K - k0
            at = tl.load(a_ptr, mask=rmask[:, None] & (kk[None, :] < left), other=0.0)
            if WORDS:
                bmask = bmask & (kc[None, :] < left // 8)
                smask = bmask
            else:
                bmask = bmask & (kc[None, :] < left // 2)
                smask = smask & (ks[None, :] < left // 16)
        w = _tile(b_ptr, s_ptr, bmask, smask, BLOCK_N, BLOCK_K, WORDS)
        acc = tl.dot(at, tl.trans(w), acc)
        if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
            u = _tile(b_ptr + up_b, s_ptr + up_s, bmask, smask, BLOCK_N, BLOCK_K, WORDS)
            acc_up = tl.dot(at, tl.trans(u), acc_up)
        a_ptr += BLOCK_K
        b_ptr += step_b
        s_ptr += step_s
    g_ptr = b_global + e * s_ge + n
    acc = acc * (tl.load(g_ptr, mask=nmask, other=0.0) * unfold)[None, :]
    if SWIGLU:
        acc_up = acc_up * (tl.load(g_ptr + N, mask=nmask, other=0.0) * unfold)[None, :]
        acc = acc * tl.sigmoid(acc) * acc_up
    store_pairs(acc, c, topk_w, rows, rmask, n, nmask, s_cm, c_map, MUL_W, C_MAP)


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
    words = WORD_DECODE if WORD_DECODE and words_aligned(w) and bk % 64 == 0 else 0
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
        UNFOLD,
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
        WORDS=words,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(a),
        **({"maxnreg": two_per_sm(warps)} if words or TWO_PER_SM else {}),
    )


def two_per_sm(warps: int) -> int:
    """The register cap that lets two programs of ``warps`` warps share an SM's 64K registers (the
    word decode's tiles at T = 8192 compile to 169 registers a thread uncapped, one program an SM,
    and to 128 with no spills capped, as the byte decode's do uncapped)."""
    return max(64, min(255, 65536 // (2 * 32 * warps)))


def _word_aligned(*parts: torch.Tensor, size: int = 4) -> bool:
    """Whether NVFP4 tensors [E, N, ...] (codes or scales; slots, and a host store beside them) can
    be read as words of ``size`` bytes: their start and row strides multiples of it (else the
    kernels read bytes)."""
    return all(
        c.data_ptr() % size == 0 and c.stride(0) % size == 0 and c.stride(1) % size == 0 for c in parts
    )


def words_aligned(w: NVFP4Tensor) -> bool:
    """Whether a bank's codes [E, N, K/2] and scales [E, N, K/16] can be read as 32-bit words (the
    scales' rows: K a multiple of 64)."""
    return _word_aligned(w.weight, w.weight_scale)


def _check(w: NVFP4Tensor, e: int, n: int, k: int, what: str) -> None:
    assert w.weight.shape == (e, n, k // 2) and w.weight.dtype == torch.uint8, (
        f"{what} codes {tuple(w.weight.shape)} {w.weight.dtype} are not uint8 [{e}, {n}, {k // 2}]"
    )
    assert w.weight_scale.shape == (e, n, k // BLOCK) and w.weight_scale.dtype == torch.float8_e4m3fn, (
        f"{what} scales {tuple(w.weight_scale.shape)} {w.weight_scale.dtype} are not "
        f"float8_e4m3fn [{e}, {n}, {k // BLOCK}]"
    )
    g = w.weight_scale_2
    assert g.shape == (e, n) and g.dtype == torch.float32, (
        f"{what} globals {tuple(g.shape)} {g.dtype} are not fp32 [{e}, {n}] (one per row)"
    )
    assert w.weight.stride(-1) == 1 and w.weight_scale.stride(-1) == 1 and g.stride(-1) == 1, (
        f"{what} codes, scales and globals must be contiguous in their last dim"
    )


def check_operands(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tokens: int | None = None,
) -> tuple[int, int, int]:
    """Shapes and dtypes both W4A16 paths need; returns (E, I, k). ``tokens``: the call's, where
    they are rows of x (``Into``)."""
    t, h = x.shape
    t = t if tokens is None else tokens
    e, two_i = w13.weight.shape[:2]
    inter = two_i // 2
    topk = ids.shape[1]
    assert x.dtype == torch.bfloat16, f"x must be bf16 (W4A16), got {x.dtype}"
    assert h % BLOCK == 0 and inter % BLOCK == 0 and two_i % 2 == 0, (
        f"H={h} and I={inter} must be multiples of {BLOCK}"
    )
    _check(w13, e, two_i, h, "w13")
    _check(w2, e, h, inter, "w2")
    assert weights.shape == ids.shape == (t, topk), f"weights/ids must be [{t}, k], got {tuple(ids.shape)}"
    return e, inter, topk


def fused_moe_w4a16(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_tokens: int | None = None,
    into: Into | None = None,
) -> torch.Tensor:
    """x [T, H] bf16; w13 codes [E, 2I, H/2], scales [E, 2I, H/16], globals [E, 2I] (gate rows then
    up rows); w2 codes [E, H, I/2], scales [E, H, I/16], globals [E, H]; weights/ids [T, k] -> [T, H].
    ``batch_tokens``: the batch whose path to take (GEMV or MMA) when x is a part of it. ``into``:
    the call's tokens are rows of x and its terms go into rows of another tensor (``Into``)."""
    if into is not None:
        into.check(x, ids, takes_gemv(batch_tokens or len(ids), w2.weight.shape[-1] * 2))
    t = len(ids)
    if t > 0 and takes_gemv(batch_tokens or t, w2.weight.shape[-1] * 2):
        from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv  # it imports _decode from here

        return fused_moe_gemv(x, w13, w2, weights, ids)
    assert x.is_cuda and w13.weight.device == x.device == w2.weight.device, (
        "fused_moe_w4a16 needs CUDA tensors on one device"
    )
    e, inter, topk = check_operands(x, w13, w2, weights, ids, tokens=t)
    if t == 0:
        return torch.zeros_like(x) if into is None else into.out
    return mma_path(_launch, x, w13, w2, weights, ids, e, inter, into)
