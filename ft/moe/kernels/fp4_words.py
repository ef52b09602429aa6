"""NVFP4 codes read as 32-bit words of eight and decoded in place, for both of the MoE GEMV's
kernels (``triton_moe_gemv.FP4_PLANES``, ``FP4_DOWN_PLANES``).

A row's codes load as words, the two of each 16-wide scale block (``fp4_words``,
``gate_up_words``); each code's magnitude bits are placed into an fp32 (no fp16 step: ``code``), the
inputs paired with each word's eight codes by reading them as bf16 pairs (no reshape of the codes:
``input_pair``), a block's sixteen products summed first and its scale multiplied in once. The
inputs are multiplied by 2^64 (``INPUT_BY``, exact) so that every product e2m1 · 2^-126 · x · 2^64
is a normal fp32; the block's sum times scale · 2^40 is the byte-wise value · 2^-22. Not here: the
kernels' loops (``moe_gemv_kernels``), the switches and why each is on (``triton_moe_gemv``), the
byte-wise decode (``fp4_decode``), integer dot products (``int_dot``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.moe.kernels.fp4_decode import e4m3

# the words' factors (powers of two, exact): inputs · 2^64 keep every product e2m1 · 2^-126 · x · 2^64
# normal, and the block's sum times scale · 2^40 is the byte-wise e2m1 · scale · 2^-22
SUMS_BY: tl.constexpr = tl.constexpr(2.0**48)
INPUT_BY: tl.constexpr = tl.constexpr(2.0**64)


@triton.jit
def fp4_words(b_e, s_e, n, k0, s_bn, s_sn, nmask, K, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    # rows n, inputs k0 .. k0+BK of one NVFP4 expert (``FP4_PLANES``): (codes as [BN, BK/16, 2]
    # 32-bit words, the two of each 16-wide block, code j of a word in its bits 4j..4j+3; the blocks'
    # scales [BN, BK/16, 1] as fp32 times ``SUMS_BY`` · 2^-8, the 2^-8 ``e4m3``'s). One 3-d shape for
    # codes, scales and inputs keeps them in one register layout.
    kb = tl.arange(0, BLOCK_K // 16)[None, :, None]
    half = tl.arange(0, 2)[None, None, :]
    rows = n[:, None, None].to(tl.int64)
    w_ptr = (b_e + rows * s_bn + k0 // 2).to(tl.pointer_type(tl.uint32)) + 2 * kb + half
    s_ptr = s_e + rows * s_sn + k0 // 16 + kb
    mask = nmask[:, None, None]
    if not EVEN_K:  # K is a multiple of 16: whole blocks (both words, one scale) are in or out
        mask = mask & (kb < (K - k0) // 16)
    words = tl.load(w_ptr, mask=mask, other=0)
    return words, e4m3(tl.load(s_ptr, mask=mask, other=0)) * SUMS_BY


@triton.jit
def gate_up_words(b_e, s_e, n, N, k0, s_bn, s_sn, nmask, K, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    # ``fp4_words`` of the gate rows n and of the up rows N below them
    wg, sg = fp4_words(b_e, s_e, n, k0, s_bn, s_sn, nmask, K, EVEN_K, BLOCK_N, BLOCK_K)
    wu, su = fp4_words(b_e, s_e, n + N, k0, s_bn, s_sn, nmask, K, EVEN_K, BLOCK_N, BLOCK_K)
    return wg, sg, wu, su


@triton.jit
def code(words, J: tl.constexpr):
    # code J of each word as fp32 e2m1 · 2^-126: the three magnitude bits go to an fp32's lowest two
    # exponent bits and top mantissa bit (subnormal for a zero exponent, which fp32 arithmetic on
    # the GPU keeps: not flushed), the sign bit to the sign. Its four bits alone (q), one multiply
    # writes two copies, at bits 22..25 and 28..31, without overlap or carries; the mask keeps the
    # first's magnitude and the second's sign: three instructions a code
    q = words & (15 << (4 * J))
    if J < 6:
        both = q * ((1 << (22 - 4 * J)) + (1 << (28 - 4 * J)))
    else:  # the copies shifted right, then left: bits 24..27 or 28..31 to 22..25, and to 28..31
        both = (q >> (4 * J - 22)) | (q << (28 - 4 * J))
    return (both & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def input_pair(
    a_row, k0, Q: tl.constexpr, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, TIMES: tl.constexpr = 1.0
):
    # inputs 8w + 2Q and 8w + 2Q + 1 of each word w of a BK step (bf16 pairs read as 32-bit words)
    # as fp32 [1, BK/16, 2] each, in the words' shape
    kb = tl.arange(0, BLOCK_K // 16)[None, :, None]
    half = tl.arange(0, 2)[None, None, :]
    ptr = (a_row + k0).to(tl.pointer_type(tl.uint32)) + 8 * kb + 4 * half + Q
    if EVEN_K:
        pair = tl.load(ptr)
    else:
        pair = tl.load(ptr, mask=kb < (K - k0) // 16, other=0)
    lo = (pair << 16).to(tl.float32, bitcast=True)
    hi = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    if TIMES != 1.0:  # exact (a power of two)
        lo, hi = lo * TIMES, hi * TIMES
    return lo, hi
