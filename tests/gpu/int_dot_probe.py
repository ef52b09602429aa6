"""A Triton kernel that runs ``triton_moe_gemv``'s integer-product steps on their own (the codes'
bytes and ``dp2a``), with or without their PTX, for tests/gpu/test_moe_gemv.py."""

from __future__ import annotations

import triton
import triton.language as tl

from ft.moe.kernels.int_dot import _dp2a, _int8_codes


@triton.jit
def int_dot_steps(words, pairs, acc, out, N: tl.constexpr, ASM: tl.constexpr):
    # out[0..3] = ``_int8_codes(words)``; out[4], out[5] = ``_dp2a`` low and high of (pairs, words, acc)
    i = tl.arange(0, N)
    w = tl.load(words + i)
    p0, p1, n0, n1 = _int8_codes(w, ASM)
    tl.store(out + i, p0)
    tl.store(out + N + i, p1)
    tl.store(out + 2 * N + i, n0)
    tl.store(out + 3 * N + i, n1)
    p = tl.load(pairs + i)
    a = tl.load(acc + i)
    tl.store(out + 4 * N + i, _dp2a(p, w, a, False, ASM))
    tl.store(out + 5 * N + i, _dp2a(p, w, a, True, ASM))
