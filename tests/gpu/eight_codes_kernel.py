"""A kernel that writes ``triton_moe_gemv._eight_codes``' eight values of each word, with the inline
PTX or its Triton twin (for tests/gpu/test_moe_gemv.py; imported only where triton is)."""

import triton
import triton.language as tl

from ft.moe.kernels.triton_moe_gemv import _eight_codes


@triton.jit
def eight_codes_kernel(words, out, PTX: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    values = _eight_codes(tl.load(words + i), PTX)
    for j in tl.static_range(8):
        tl.store(out + j * N + i, values[j])
