"""NVFP4 codes and scales decoded in registers, the pieces the W4A16 kernels share.

Integer ops only, no fp8 or fp4 units: an E2M1 code's bits placed into an fp16 exponent/mantissa
give ``value · 2^-14`` (``e2m1``) and an E4M3 byte's give ``scale · 2^-8`` (``e4m3``); their fp32
product ``value · scale · 2^-22`` has at most six significant bits, so it is exact in bf16, and a
kernel folds the ``2^22`` (``UNFOLD``) into the row's global. ``decode`` / ``decode_f32`` do that a
tile at a time. The table decode (``decode_lut``, ``triton_w4a16.LUT``) gives the same values at
their true magnitudes from PRMT byte tables in inline PTX (``LUT_LO`` / ``LUT_HI``), half a word's
codes a call, with an interpreter twin. Not here: the kernels (``triton_w4a16_kernel``,
``moe_gemv_kernels``, ``gluon_w4a16_kernel``), the MoE GEMV's codes read as 32-bit words (``fp4_words``),
the format itself (``ft.quant.nvfp4``).
"""

from __future__ import annotations

import triton
import triton.language as tl

UNFOLD = float(2**22)  # undoes the 2^-14 · 2^-8 of the fp16 bit placement


@triton.jit
def decode(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # packed uint8 [BN, BK/2] (element 2i in the low nibble), scale uint8 [BN, BK/16] (e4m3 bits)
    # -> bf16 [BN, BK] holding e2m1 · scale · 2^-22, exactly (at most 6 significant bits)
    return decode_f32(packed, scale, BLOCK_N, BLOCK_K).to(tl.bfloat16)


@triton.jit
def decode_f32(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # ``decode`` in fp32, for callers that multiply in fp32 (the GEMV): the same values, one
    # rounding to bf16 and one widening back fewer per element
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, BLOCK_K])
    s = tl.reshape(tl.broadcast_to(e4m3(scale)[:, :, None], [BLOCK_N, BLOCK_K // 16, 16]), [BLOCK_N, BLOCK_K])
    return e2m1(codes) * s


# ``LUT`` decode: per packed word (eight codes), PRMT byte tables give each value's bf16 bytes, its
# sign ORed in, and one bf16x2 multiply by the block's scale, exact (value x scale has at most six
# significant bits and lies in [2^-10, 2688]); half the word's codes a call ("lo": bytes 0-1). The
# template's SHIFT brings the call's two bytes down into sel, SIGNS picks their signs.
_LUT_ASM = """{
.reg .b32 sel, x, sg, lo, hi, ta, tb, w0, w1;
mov.b32 ta, 0xC0800000;
mov.b32 tb, 0xC0804000;
SHIFT
and.b32 sel, sel, 0x7777;
prmt.b32 lo, ta, tb, sel;
mov.b32 ta, 0x3F3F3F00;
mov.b32 tb, 0x40404040;
prmt.b32 hi, ta, tb, sel;
shl.b32 x, $2, 4;
prmt.b32 sg, x, $2, SIGNS;
and.b32 sg, sg, 0x80808080;
or.b32 hi, hi, sg;
prmt.b32 w0, lo, hi, 0x5140;
prmt.b32 w1, lo, hi, 0x7362;
mul.rn.bf16x2 $0, w0, $3;
mul.rn.bf16x2 $1, w1, $3;
}"""

LUT_LO = tl.constexpr(_LUT_ASM.replace("SHIFT", "mov.b32 sel, $2;").replace("SIGNS", "0x5140"))
LUT_HI = tl.constexpr(_LUT_ASM.replace("SHIFT", "shr.b32 sel, $2, 16;").replace("SIGNS", "0x7362"))


@triton.jit
def decode_lut(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    # packed uint8 [BN, BK/2], scale uint8 [BN, BK/16] (e4m3 bits) -> bf16 (wa, wb) [BN, BK/2] holding
    # e2m1 · scale at their true magnitudes, wa's position 4q + i the code of input 8q + i and wb's
    # that of input 8q + 4 + i (i < 4): the inputs the kernel's activations take in that order
    s = lut_scale(scale)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // 16, 8]), [BLOCK_N, BLOCK_K // 2])
    if ASM:
        wa = tl.inline_asm_elementwise(LUT_LO, "=r,=r,r,r,r", [packed, s], tl.bfloat16, True, 4)
        wb = tl.inline_asm_elementwise(LUT_HI, "=r,=r,r,r,r", [packed, s], tl.bfloat16, True, 4)
    else:  # the interpreter: the same values by the fp16 placement, in the same order
        halves = tl.permute(tl.reshape(packed, [BLOCK_N, BLOCK_K // 8, 2, 2]), [0, 1, 3, 2])
        ha, hb = tl.split(halves)  # [BN, BK/8, 2]: bytes 4q, 4q + 1 and bytes 4q + 2, 4q + 3
        sf = s.to(tl.float32)
        wa = e2m1(tl.reshape(tl.join(ha & 0xF, ha >> 4), [BLOCK_N, BLOCK_K // 2])) * 16384.0 * sf
        wb = e2m1(tl.reshape(tl.join(hb & 0xF, hb >> 4), [BLOCK_N, BLOCK_K // 2])) * 16384.0 * sf
        wa, wb = wa.to(tl.bfloat16), wb.to(tl.bfloat16)
    return wa, wb


@triton.jit
def lut_scale(scale):
    # e4m3 bits (uint8, any shape) -> the block scale as bf16 at its true magnitude, the operand the
    # table decode's bf16x2 multiply takes (exact: e4m3 has 4 significant bits)
    return (e4m3(scale) * 256.0).to(tl.bfloat16)


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
def lut_dots(a0, a1, wa, wb, acc):
    # acc += a0 @ wa.T + a1 @ wb.T: the two halves of a K step
    return tl.dot(a1, tl.trans(wb), tl.dot(a0, tl.trans(wa), acc))
