"""``triton_w4a16._words`` (the MMA kernel's codes decoded from 32-bit words, ``WORD_DECODE``)
gives ``_decode``'s bf16 weights bit for bit, under Triton's interpreter on CPU tensors: every
code (signs and the subnormal 0.5 included) under every positive E4M3 scale. The interpreter's
``tl.dot`` mishandles bf16 (see ``check_grouped_gemm``), so the kernel around them is left to
the GPU tests (tests/nvfp4/test_w4a16_gpu.py)."""

from __future__ import annotations

import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER

try:
    import triton
    import triton.language as tl

    from ft.moe.kernels import triton_w4a16

    @triton.jit
    def _both_kernel(
        codes, scales, by_bytes, by_words, s_c, s_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        n = tl.arange(0, BLOCK_N)[:, None]
        kb = tl.arange(0, BLOCK_K // 2)[None, :]
        ks = tl.arange(0, BLOCK_K // 16)[None, :]
        kw = tl.arange(0, BLOCK_K // 8)[None, :]
        kk = tl.arange(0, BLOCK_K)[None, :]
        w = triton_w4a16._decode(
            tl.load(codes + n * s_c + kb), tl.load(scales + n * s_s + ks), BLOCK_N, BLOCK_K
        )
        tl.store(by_bytes + n * BLOCK_K + kk, w)
        words = tl.load((codes + n * s_c).to(tl.pointer_type(tl.uint32)) + kw)
        scale_words = tl.load((scales + n * s_s).to(tl.pointer_type(tl.uint32)) + kw // 8)
        w = triton_w4a16._words(words, scale_words, BLOCK_N, BLOCK_K)
        tl.store(by_words + n * BLOCK_K + kk, w)

    @triton.jit
    def _bits_kernel(words, out, N: tl.constexpr):
        i = tl.arange(0, N)
        w = tl.load(words + i)
        for j in tl.static_range(8):  # what the GPU's packed bf16 multiplies take
            tl.store(out + i * 8 + j, triton_w4a16._code_bits(w, j, 0x1C0, 0x8000).to(tl.int32))

except ImportError:  # no triton: the test is skipped
    pass


def check_words_equal_bytes() -> None:
    n, k = 16, 128  # 16 rows of 8 blocks: 128 scales
    # every positive finite e4m3 (0x01 .. 0x7E: subnormal scales too), two of them again
    scales = torch.cat([torch.arange(1, 127), torch.tensor([0x7E, 0x01])]).to(torch.uint8).view(n, k // 16)
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256)  # every pair of codes in a byte
    by_bytes = torch.zeros(n, k, dtype=torch.bfloat16)
    by_words = torch.ones(n, k, dtype=torch.bfloat16)
    _both_kernel[(1,)](
        codes, scales, by_bytes, by_words, codes.stride(0), scales.stride(0), BLOCK_N=n, BLOCK_K=k
    )
    if not torch.equal(by_words.view(torch.int16), by_bytes.view(torch.int16)):  # raised: may run under -O
        bad = (by_words.view(torch.int16) != by_bytes.view(torch.int16)).nonzero()[:4].tolist()
        raise AssertionError(f"words differ from bytes at {bad}")
    # and both are the format's values: e2m1 · scale · 2^-22
    from ft.quant.nvfp4 import E2M1_VALUES

    low, high = (codes & 15).long(), (codes >> 4).long()
    values = torch.stack([E2M1_VALUES[low], E2M1_VALUES[high]], -1).view(n, k)
    scale = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
    want = (values * scale * 2.0**-22).to(torch.bfloat16)
    if not torch.equal(by_bytes, want):
        raise AssertionError("the byte-wise decode is not e2m1 · scale · 2^-22")


def check_code_bits() -> None:
    """``_code_bits``: the bf16 bits of e2m1 · 2^-126 for each of a word's eight codes, every code in
    every position (the GPU multiplies these bits; the interpreter's check above multiplies in fp32)."""
    from ft.quant.nvfp4 import E2M1_VALUES

    codes = (torch.arange(8)[None, :] + torch.arange(16)[:, None]) % 16  # word w: code (j + w) % 16 at j
    words = (codes << (4 * torch.arange(8))).sum(1).to(torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = torch.zeros(16, 8, dtype=torch.int32)
    _bits_kernel[(1,)](words.view(torch.uint32) if hasattr(torch, "uint32") else words, out, N=16)
    want = (E2M1_VALUES[codes] * 2.0**-126).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    if not torch.equal(out, want):
        raise AssertionError(f"code bits {out.tolist()} against {want.tolist()}")


def test_word_decode_equals_the_byte_decode():
    run_check("tests.nvfp4.test_word_decode", "check_words_equal_bytes")


def test_word_code_bits():
    run_check("tests.nvfp4.test_word_decode", "check_code_bits")


def test_codes_read_as_words_only_where_aligned():
    """Codes and scales both: rows of K/2 and K/16 bytes, multiples of 4 (K a multiple of 64)."""
    from ft.moe.kernels.triton_w4a16 import words_aligned
    from ft.quant.nvfp4 import NVFP4Tensor

    def bank(k: int, codes=None) -> NVFP4Tensor:
        codes = torch.zeros(4, 8, k // 2, dtype=torch.uint8) if codes is None else codes
        scales = torch.zeros(4, 8, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return NVFP4Tensor(codes, scales, torch.ones(4, 8))

    assert words_aligned(bank(128))
    assert not words_aligned(bank(96))  # scale rows of 6 bytes
    assert not words_aligned(bank(128, torch.zeros(4, 8, 65, dtype=torch.uint8)[:, :, :64]))  # 65-byte rows
    assert not words_aligned(bank(128, torch.zeros(4 * 8 * 64 + 1, dtype=torch.uint8)[1:].view(4, 8, 64)))
