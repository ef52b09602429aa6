"""The NVFP4 table decode's inline PTX (``fp4_decode.LUT_LO`` / ``LUT_HI``) run by a small emulator
of the instructions it uses, on the CPU: every code byte and every E4M3 scale, bit for bit against
E2M1 value x scale. On a GPU these
strings run only inside the kernels, where a wrong selector shows as a wrong GEMM; here each is
checked alone."""

from __future__ import annotations

import re

import pytest
import torch

from ft.quant.nvfp4 import E2M1_VALUES

pytest.importorskip("triton")  # the PTX strings live in the kernel modules


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> their bf16 bit patterns (round to nearest even), int64."""
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def bf16_value(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 in its default mode: byte i of the result is byte (sel's nibble i & 7) of b:a,
    or that byte's sign bit repeated when the nibble's bit 3 is set."""
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nibble = (sel >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def mul_bf16x2(a: int, b: int) -> int:
    halves = []
    for shift in (0, 16):
        prod = torch.tensor(bf16_value((a >> shift) & 0xFFFF) * bf16_value((b >> shift) & 0xFFFF))
        halves.append(int(bf16_bits(prod.float())) << shift)
    return halves[0] | halves[1]


def run_ptx(text: str, args: list[int], outputs: int) -> list[int]:
    """Run the instructions of an inline-asm string (mov, prmt, and, or, shl, shr, mul.rn.bf16x2 on
    .b32 registers) with ``$i`` bound to ``args`` (inputs after the ``outputs`` output slots)."""
    regs = {f"${i + outputs}": v & 0xFFFFFFFF for i, v in enumerate(args)}

    def value(token: str) -> int:
        token = token.strip()
        return int(token, 0) & 0xFFFFFFFF if token[0].isdigit() else regs[token]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[dst] = value(src[0])
        elif op == "prmt.b32":
            regs[dst] = prmt(value(src[0]), value(src[1]), value(src[2]))
        elif op == "and.b32":
            regs[dst] = value(src[0]) & value(src[1])
        elif op == "or.b32":
            regs[dst] = value(src[0]) | value(src[1])
        elif op == "shl.b32":
            regs[dst] = (value(src[0]) << value(src[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = value(src[0]) >> value(src[1])
        elif op == "mul.rn.bf16x2":
            regs[dst] = mul_bf16x2(value(src[0]), value(src[1]))
        else:
            raise AssertionError(f"instruction {op!r} not emulated")
    return [regs[f"${i}"] for i in range(outputs)]


E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
SCALES = [s for s in range(256) if torch.isfinite(E4M3[s]) and E4M3[s] > 0]  # the scales a block may have


def pair(byte: int, scale: float) -> int:
    """The bf16x2 of a code byte's two values (low nibble first) times ``scale``."""
    lo, hi = E2M1_VALUES[byte & 0xF] * scale, E2M1_VALUES[byte >> 4] * scale
    return int(bf16_bits(lo)) | int(bf16_bits(hi)) << 16


def scale_pair(scale: float) -> int:
    bits = int(bf16_bits(torch.tensor(scale)))
    return bits | bits << 16


@pytest.mark.parametrize("name", ["LUT_LO", "LUT_HI"])
def test_table_decode_of_a_word(name):
    """LUT_LO decodes bytes 0 and 1 of a packed word, LUT_HI bytes 2 and 3, each into its bf16 pair
    times the block's scale ($3): every byte value in every position, across the scales."""
    from ft.moe.kernels import fp4_decode

    text = getattr(fp4_decode, name).value
    first = 0 if name == "LUT_LO" else 2
    gen = torch.Generator().manual_seed(0)
    for b in range(256):
        for s in torch.tensor(SCALES)[torch.randperm(len(SCALES), generator=gen)[:4]].tolist():
            other = torch.randint(0, 256, (3,), generator=gen).tolist()
            word = bytes(other[:first] + [b] + other[first:])  # b at byte `first`, randoms elsewhere
            word, scale = int.from_bytes(word + bytes(4 - len(word)), "little"), E4M3[s].item()
            got = run_ptx(text, [word, scale_pair(scale), 0], outputs=2)
            want = [pair(word >> (8 * (first + i)) & 0xFF, scale) for i in range(2)]
            assert got == want, (name, hex(word), s, [hex(g) for g in got], [hex(w) for w in want])


def test_emulator_catches_a_wrong_selector():
    """The check above fails for a table decode whose byte selector is wrong (bytes 1 and 0 swapped)."""
    from ft.moe.kernels import fp4_decode

    text = fp4_decode.LUT_LO.value
    wrong = re.sub(r"prmt\.b32 w0, lo, hi, 0x5140", "prmt.b32 w0, lo, hi, 0x7362", text)
    assert wrong != text
    assert run_ptx(text, [0x4321, scale_pair(1.0), 0], outputs=2) == [pair(0x21, 1.0), pair(0x43, 1.0)]
    assert run_ptx(wrong, [0x4321, scale_pair(1.0), 0], outputs=2) != [pair(0x21, 1.0), pair(0x43, 1.0)]
