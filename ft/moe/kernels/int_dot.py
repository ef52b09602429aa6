"""NVFP4 codes times int16 input blocks as exact integer dot products, for the MoE GEMV's
gate/up kernel (``triton_moe_gemv.FP4_INT_DOT``), and the quantisation of inputs into those blocks.

An input row is cut into 16-wide blocks (an NVFP4 scale block's width); each block is multiplied
by the power of two 2^(14 - E), E the exponent of its largest magnitude, and rounded to int16
(``quantize_range``; the block's factor 2^(E - 29) kept in fp32). A block's sixteen codes are one
64-bit load of two words whose codes become int8 magnitudes 2 · |e2m1| by one ``prmt`` from a
table per four codes (``_int8_codes``, the positive and the negative codes apart), and ``dp2a``
(two int16 inputs times two int8 codes into an int32) takes the products: a block's sum is an
exact integer (|sum| < 16 · 12 · 2^15 < 2^24, exact in fp32 too), which the GEMV multiplies once
by the block's scale times the input block's factor. An input is exact in its int16 unless it is
below 2^-7 of its block's largest magnitude, whose bits below 2^-15 of that magnitude are rounded
off (bf16 keeps 8 bits: x = m · 2^(e-7), and 2^(14-E) · 2^(e-7) is an integer for e >= E - 7).

The blocks come from the fused router, which reads every input anyway (``triton_router_gemv``
calls ``quantize_range`` and leaves them on x as ``BLOCKS_ATTR``, taken once by ``take_blocks``),
or else from ``quantize_blocks``' own launch. Under Triton's interpreter (no PTX) the permutes
and ``dp2a`` run as plain arithmetic (``ASM`` false), to the same integers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous
from ft.moe.kernels.fp4_decode import e4m3

# the quantised inputs' block exponents are clamped to [MIN_EXP, 127] (a block of zeros, or of
# values below 2^-96, then rounds to zeros) so that 2^(14 - E) and the factor 2^(E - 29) are normal
MIN_EXP: tl.constexpr = tl.constexpr(-96)


@triton.jit
def quantize_range(x, xq, xf, M, k0, K, s_xt, s_qt, s_ft, T_P: tl.constexpr, BLOCK: tl.constexpr):
    # x[t, k] -> xq[t, k] int16 = round(x · 2^(14 - E)) and xf[t, b] = 2^(E - 29) for tokens t < M
    # and inputs k0 .. k0+BLOCK below K (a multiple of 16), E the exponent of block b's largest
    # magnitude (16 inputs a block, ``FP4_INT_DOT``): the int16 never overflows, |x| < 2^(E+1)
    # gives |xq| < 2^15. The factor's 2^(E-14) undoes the int16's scaling, 2^-1 the codes' factor
    # 2, and 2^-14 with ``e4m3``'s 2^-8 makes the kernels' unit of 2^-22. ``_quantize_kernel``
    # runs it, and the fused router for the inputs it reads (``triton_router_gemv``).
    t = tl.arange(0, T_P)[:, None].to(tl.int64)
    k = k0 + tl.arange(0, BLOCK)[None, :]
    mask = (t < M) & (k < K)
    v = tl.load(x + t * s_xt + k, mask=mask, other=0.0).to(tl.float32)
    v = tl.reshape(v, [T_P, BLOCK // 16, 16])
    top = tl.max(tl.abs(v), axis=2)  # [T_P, BLOCK/16]
    e = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, MIN_EXP), 127)
    q = v * ((141 - e) << 23).to(tl.float32, bitcast=True)[:, :, None]  # x · 2^(14 - E): exact
    q = (q + tl.where(q >= 0, 0.5, -0.5)).to(tl.int32)  # to the nearest, halves away from zero
    tl.store(xq + t * s_qt + k, tl.reshape(q, [T_P, BLOCK]).to(tl.int16), mask=mask)
    b = k0 // 16 + tl.arange(0, BLOCK // 16)[None, :]
    tl.store(xf + t * s_ft + b, ((98 + e) << 23).to(tl.float32, bitcast=True), mask=(t < M) & (b < K // 16))


@triton.jit
def _quantize_kernel(x, xq, xf, M, K, s_xt, s_qt, s_ft, T_P: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = False):  # fmt: skip
    wait_for_previous(USE_PDL)
    quantize_range(x, xq, xf, M, tl.program_id(0) * BLOCK, K, s_xt, s_qt, s_ft, T_P, BLOCK)


def empty_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for x's int16 blocks: (xq [T, K] int16, xf [T, K/16] fp32)."""
    t, k = x.shape
    assert k % 16 == 0, f"K={k}: the int16 blocks are 16 inputs wide"
    return (torch.empty(t, k, dtype=torch.int16, device=x.device),
            torch.empty(t, k // 16, dtype=torch.float32, device=x.device))  # fmt: skip


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (K a multiple of 16) -> (xq [T, K] int16, xf [T, K/16] fp32), ``quantize_range``."""
    (t, k), (xq, xf) = x.shape, empty_blocks(x)
    block = min(256, triton.next_power_of_2(k))
    if t > 0:
        _quantize_kernel[(triton.cdiv(k, block),)](
            x, xq, xf, t, k, x.stride(0), xq.stride(0), xf.stride(0), T_P=triton.next_power_of_2(t),
            BLOCK=block, num_warps=4, **pdl_args(x),
        )  # fmt: skip
    return xq, xf


# The fused router leaves x's int16 blocks on x as this attribute (``TopKRouter``, asked by the
# block when its bank takes them), and ``launch_moe_gemv`` takes them from there (once: it deletes
# the attribute) instead of launching ``_quantize_kernel``.
BLOCKS_ATTR = "ft_int_blocks"


def take_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int16 blocks the router left on x, if any (removed from x: a handoff, used once)."""
    blocks = getattr(x, BLOCKS_ATTR, None)
    if blocks is not None:
        delattr(x, BLOCKS_ATTR)
        if blocks[0].shape != x.shape or blocks[0].device != x.device:
            return None
    return blocks


# 2 · e2m1 of codes 0..7 as bytes (the table ``prmt`` indexes, two words), and the codes' sign bits
POS_LO: tl.constexpr = tl.constexpr(0x03020100)
POS_HI: tl.constexpr = tl.constexpr(0x0C080604)
SIGNS: tl.constexpr = tl.constexpr(0x88888888 - (1 << 32))


@triton.jit
def _asm3(op: tl.constexpr, a, b, c):
    # one PTX instruction ``op d, a, b, c`` on int32 tensors of one shape
    return tl.inline_asm_elementwise(
        op + " $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _byte(v, J: tl.constexpr):
    # byte J of int32 v as a signed value
    return (v << (24 - 8 * J)) >> 24


@triton.jit
def _int8_codes(words, ASM: tl.constexpr):
    # a word's eight codes (code j in bits 4j..4j+3, int32) as int8 magnitudes 2 · |e2m1|, split by
    # sign: (pos0, pos1, neg0, neg1), codes 0..3 in the first word of each pair and 4..7 in the
    # second, code j in byte j % 4, a code's magnitude in pos if it is positive, in neg if negative
    # (the other holds 0). With ASM each word is one ``prmt`` from one table of eight bytes: the
    # selector's nibble (the code) picks byte (its 3 low bits) of the table, or with bit 3 set
    # (prmt's sign mode) replicates that byte's top bit, 0 for this table; neg takes the codes with
    # the sign bit flipped. prmt reads the selector's low 16 bits, so codes 4..7 are shifted down.
    # Seven instructions a word (a flip, two shifts, four permutes), no select.
    flipped = words ^ SIGNS
    if ASM:
        lo = tl.full(words.shape, POS_LO, tl.int32)
        hi = tl.full(words.shape, POS_HI, tl.int32)
        return (
            _asm3("prmt.b32", lo, hi, words), _asm3("prmt.b32", lo, hi, words >> 16),
            _asm3("prmt.b32", lo, hi, flipped), _asm3("prmt.b32", lo, hi, flipped >> 16),
        )  # fmt: skip
    return _magnitudes(words, 0), _magnitudes(words, 4), _magnitudes(flipped, 0), _magnitudes(flipped, 4)


@triton.jit
def _magnitudes(words, J0: tl.constexpr):
    # codes J0 .. J0+3 of each word as bytes 2 · |e2m1| where the code's sign bit is clear, else 0
    # (``_int8_codes`` by arithmetic: the interpreter runs no PTX)
    out = tl.zeros(words.shape, tl.int32)
    for j in tl.static_range(4):
        c = (words >> (4 * (J0 + j))) & 15
        m = c & 7
        mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        out |= tl.where(c < 8, mag, 0) << (8 * j)
    return out


@triton.jit
def _dp2a(pairs, codes, acc, HI: tl.constexpr, ASM: tl.constexpr):
    # acc + pairs.lo16 · codes.byte(2·HI) + pairs.hi16 · codes.byte(2·HI + 1), all signed (``dp2a``)
    if ASM:
        if HI:
            return _asm3("dp2a.hi.s32.s32", pairs, codes, acc)
        return _asm3("dp2a.lo.s32.s32", pairs, codes, acc)
    return acc + ((pairs << 16) >> 16) * _byte(codes, 2 * HI) + (pairs >> 16) * _byte(codes, 2 * HI + 1)


@triton.jit
def fp4_blocks(b_e, s_e, n, k0, s_bn, s_sn, nmask, K, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    # rows n, inputs k0 .. k0+BK of one NVFP4 expert (``FP4_INT_DOT``): each 16-wide block's codes
    # as one 64-bit load, split into its two words (int32 [BN, BK/16] each, code j of a word in
    # bits 4j..4j+3), and the blocks' scales (fp32 · 2^-8, ``e4m3``), all in one 2-d shape (one
    # register layout: no shared-memory exchange between the codes' and the scales' in the loop)
    kb = tl.arange(0, BLOCK_K // 16)[None, :]
    rows = n[:, None].to(tl.int64)
    w_ptr = (b_e + rows * s_bn + k0 // 2).to(tl.pointer_type(tl.uint64)) + kb
    s_ptr = s_e + rows * s_sn + k0 // 16 + kb
    mask = nmask[:, None]
    if not EVEN_K:  # K is a multiple of 16: whole blocks are in or out
        mask = mask & (kb < (K - k0) // 16)
    w = tl.load(w_ptr, mask=mask, other=0)
    return _low32(w), _high32(w), e4m3(tl.load(s_ptr, mask=mask, other=0))


@triton.jit
def int_inputs(xq_row, xf_row, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    # int16 inputs k0 .. k0+BK (``quantize_blocks``): four 64-bit loads a block, each two pairs,
    # as eight int32 [1, BK/16] (pair Q holds the block's inputs 2Q, low half, and 2Q + 1), and the
    # blocks' factors [1, BK/16]
    kb = tl.arange(0, BLOCK_K // 16)[None, :]
    ptr = (xq_row + k0).to(tl.pointer_type(tl.uint64)) + 4 * kb
    f_ptr = xf_row + k0 // 16 + kb
    if EVEN_K:
        q0, q1, q2, q3 = tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
        factor = tl.load(f_ptr)
    else:
        mask = kb < (K - k0) // 16
        q0, q1 = tl.load(ptr, mask=mask, other=0), tl.load(ptr + 1, mask=mask, other=0)
        q2, q3 = tl.load(ptr + 2, mask=mask, other=0), tl.load(ptr + 3, mask=mask, other=0)
        factor = tl.load(f_ptr, mask=mask, other=0.0)
    return (
        _low32(q0),
        _high32(q0),
        _low32(q1),
        _high32(q1),
        _low32(q2),
        _high32(q2),
        _low32(q3),
        _high32(q3),
        factor,
    )


@triton.jit
def _low32(v):
    # the low word of 64-bit v, as int32 bits
    return (v & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)


@triton.jit
def _high32(v):
    # the high word of 64-bit v, as int32 bits
    return (v >> 32).to(tl.uint32).to(tl.int32, bitcast=True)


@triton.jit
def int_block_sums(lo, hi, p0, p1, p2, p3, p4, p5, p6, p7, ASM: tl.constexpr):
    # the sixteen products of each block (words lo and hi, [BN, BK/16]) with its int16 inputs
    # (pairs p0..p7, [1, BK/16]), summed: int32 [BN, BK/16], exact. The positive codes' products
    # and the negative ones' are summed apart (``_int8_codes``), eight ``dp2a`` a word
    a0, a1, n0, n1 = _int8_codes(lo, ASM)
    b0, b1, m0, m1 = _int8_codes(hi, ASM)
    zero = tl.zeros(lo.shape, tl.int32)
    pos = _dp4(a0, p0, p1, zero, ASM)
    neg = _dp4(n0, p0, p1, zero, ASM)
    pos = _dp4(a1, p2, p3, pos, ASM)
    neg = _dp4(n1, p2, p3, neg, ASM)
    pos = _dp4(b0, p4, p5, pos, ASM)
    neg = _dp4(m0, p4, p5, neg, ASM)
    pos = _dp4(b1, p6, p7, pos, ASM)
    neg = _dp4(m1, p6, p7, neg, ASM)
    return pos - neg


@triton.jit
def _dp4(codes, pa, pb, acc, ASM: tl.constexpr):
    # acc + the four products of a word's bytes with their inputs (pairs pa, pb): two ``dp2a``
    acc = _dp2a(tl.broadcast_to(pa, codes.shape), codes, acc, False, ASM)
    return _dp2a(tl.broadcast_to(pb, codes.shape), codes, acc, True, ASM)
