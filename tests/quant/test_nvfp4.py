"""Tests for the NVFP4 reference: known bytes and floats, ModelOpt's rounding, edge blocks."""

from __future__ import annotations

import pytest
import torch

from ft.quant import nvfp4

G = 2.0**-8  # a global scale that keeps every product below exact in fp32
BIG = 6.0 * 448.0 * G  # a block amax that makes quantize pick exactly G as the global


def _fp8(x: float) -> torch.Tensor:
    return torch.tensor(x).to(torch.float8_e4m3fn)


def _block_scale_per_element(q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    return q.weight_scale.float().repeat_interleave(16, dim=-1) * q.weight_scale_2  # [out, in]


def test_e2m1_values_follow_code_bits() -> None:
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(nvfp4.E2M1_VALUES[:8], mags)
    assert torch.equal(nvfp4.E2M1_VALUES[8:], -mags)
    assert torch.signbit(nvfp4.E2M1_VALUES[8])  # code 8 is -0.0


def test_pack_known_bytes_and_unpack() -> None:
    # +0.5=1, -6=15, +6=7, -0.5=9, 0=0; element 2i goes in the low nibble.
    codes = torch.tensor([[1, 15, 7, 9, 0, 7, 15, 0, 9, 1]], dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.tolist() == [[0xF1, 0x97, 0x70, 0x0F, 0x19]]
    assert torch.equal(nvfp4.unpack_codes(packed), codes)


def test_pack_unpack_random_round_trip_with_batch_dims() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 32), generator=gen).to(torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(nvfp4.unpack_codes(packed), codes)


def test_pack_rejects_codes_above_15() -> None:
    with pytest.raises(AssertionError, match="0..15"):
        nvfp4.pack_codes(torch.tensor([16, 0], dtype=torch.uint8))


def test_dequantize_hand_built_tensor() -> None:
    row0 = [0xF1, 0x97, 0x70, 0x0F, 0x19, 0x00, 0x00, 0x00]  # codes 1,15,7,9,0,7,15,0,9,1,0...
    row1 = [0x77, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xA2]  # codes 7,7,0...,2,10
    weight = torch.tensor([row0, row1], dtype=torch.uint8)  # [2, 8] -> in = 16
    weight_scale = torch.stack([_fp8(2.0), _fp8(0.375)]).view(2, 1)
    global_scale = torch.tensor(0.25)
    out = nvfp4.dequantize(weight, weight_scale, global_scale)
    # row 0 scale*global = 0.5; row 1 = 0.09375
    expected0 = [0.25, -3.0, 3.0, -0.25, 0.0, 3.0, -3.0, 0.0, -0.25, 0.25] + [0.0] * 6
    expected1 = [0.5625, 0.5625] + [0.0] * 12 + [0.09375, -0.09375]
    assert out.tolist() == [expected0, expected1]
    assert nvfp4.dequantize(weight, weight_scale, global_scale, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_reproduces_exact_grid_values() -> None:
    # Each block holds the 16 code values times a scale s that is exact in e4m3 (448 down to
    # the smallest subnormal 2^-9), so quantize must find s, G and every code exactly.
    scales = [448.0, 1.0, 0.5, 2.0**-9]
    w = torch.cat([nvfp4.E2M1_VALUES * s * G for s in scales]).view(1, 64)
    q = nvfp4.quantize(w)
    assert q.weight_scale_2.item() == G
    assert q.weight_scale.float().view(-1).tolist() == scales
    expected_codes = list(range(16))
    expected_codes[8] = 0  # an input of -0.0 is not negative, so it gets code 0
    assert nvfp4.unpack_codes(q.weight).view(4, 16).tolist() == [expected_codes] * 4
    assert torch.equal(q.dequantize(), w)


def test_quantize_rounds_to_nearest_with_ties_to_even_code() -> None:
    # Block 0 fixes the global at G; block 1 has amax 6G so its scale is exactly 1.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0]
    near = [0.3, 1.2, 4.9, 5.1, -0.1, 6.0, 0.0]
    w = torch.tensor([BIG] + [0.0] * 15 + ties + near) * torch.tensor([1.0] * 16 + [G] * 16)
    q = nvfp4.quantize(w.view(1, 32))
    assert q.weight_scale.float().view(-1).tolist() == [448.0, 1.0]
    codes = nvfp4.unpack_codes(q.weight).view(-1)[16:].tolist()
    # ties: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4, -0.75->-1, -5->-4
    # near: 0.3->0.5, 1.2->1.0, 4.9->4, 5.1->6, -0.1->-0 (sign kept, as ModelOpt), 6, 0
    assert codes == [0, 2, 2, 4, 4, 6, 6, 10, 14] + [1, 2, 6, 7, 8, 7, 0]


def test_underflowing_block_scale_gives_zero_codes() -> None:
    # Global = 1, so a block of 1e-3 needs scale 1.7e-4, below half the smallest e4m3
    # subnormal (2^-10): the fp8 scale is 0 and the block must not turn into NaN.
    w = torch.zeros(2, 32)
    w[0, :16] = 2688.0
    w[0, 16:] = 1e-3
    w[1, 16:] = -1e-3
    q = nvfp4.quantize(w)
    assert q.weight_scale_2.item() == 1.0
    assert q.weight_scale.float().tolist() == [[448.0, 0.0], [0.0, 0.0]]
    codes = nvfp4.unpack_codes(q.weight)
    assert codes[:, 16:].eq(0).all() and codes[1].eq(0).all()
    dq = q.dequantize()
    assert torch.isfinite(dq).all()
    assert dq[:, 16:].eq(0).all()
    assert dq[0, :16].eq(2688.0).all()


def test_all_zero_tensor() -> None:
    q = nvfp4.quantize(torch.zeros(4, 32))
    assert q.weight_scale_2.item() == 0.0 and q.weight_scale_2.dim() == 0
    assert q.weight.eq(0).all() and q.weight.shape == (4, 16) and q.weight.dtype == torch.uint8
    assert q.weight_scale.float().eq(0).all() and q.weight_scale.shape == (4, 2)
    dq = q.dequantize()
    assert torch.isfinite(dq).all() and dq.eq(0).all()


def test_scale_saturates_when_global_is_subnormal() -> None:
    # The global 2.4 * 2^-149 rounds down to 2 * 2^-149, so the block ratio is ~537 > 448;
    # unsaturated it would become an fp8 NaN.
    a = 2688 * 2.4 * 2.0**-149
    q = nvfp4.quantize(torch.tensor([[a, -a / 2] + [0.0] * 14]))
    assert q.weight_scale_2.item() == 2 * 2.0**-149
    assert q.weight_scale.float().item() == 448.0
    assert torch.isfinite(q.dequantize()).all()


def test_global_underflowing_to_zero_gives_zeros() -> None:
    q = nvfp4.quantize(torch.tensor([[1e-43, -1e-43] + [0.0] * 14]))
    assert q.weight_scale_2.item() == 0.0
    assert q.weight.eq(0).all() and q.weight_scale.float().eq(0).all()
    assert q.dequantize().eq(0).all()


def test_gate_up_bank_with_per_row_globals() -> None:
    gen = torch.Generator().manual_seed(1)
    inter, hidden = 8, 64
    gate = nvfp4.quantize(torch.randn(inter, hidden, generator=gen) * 0.02)
    up = nvfp4.quantize(torch.randn(inter, hidden, generator=gen) * 0.5)
    assert gate.weight_scale_2 != up.weight_scale_2  # otherwise the test proves nothing

    weight = torch.cat([gate.weight, up.weight])  # [2I, H/2]
    weight_scale = torch.cat([gate.weight_scale, up.weight_scale])  # [2I, H/16]
    globals_ = torch.cat([gate.weight_scale_2.expand(inter), up.weight_scale_2.expand(inter)])  # [2I]
    expected = torch.cat([gate.dequantize(), up.dequantize()])  # [2I, H]
    assert torch.equal(nvfp4.dequantize(weight, weight_scale, globals_), expected)
    # One scalar for the bank would be wrong for the up rows.
    assert not torch.equal(nvfp4.dequantize(weight, weight_scale, gate.weight_scale_2), expected)

    # Expert stack [E, 2I, H/2] with globals [E, 2I], and per-expert globals as [E, 1].
    bank = nvfp4.dequantize(
        torch.stack([weight, weight.flip(0)]),
        torch.stack([weight_scale, weight_scale.flip(0)]),
        torch.stack([globals_, globals_.flip(0)]),
    )
    assert torch.equal(bank, torch.stack([expected, expected.flip(0)]))
    per_expert = nvfp4.dequantize(
        torch.stack([gate.weight, up.weight]),
        torch.stack([gate.weight_scale, up.weight_scale]),
        torch.stack([gate.weight_scale_2, up.weight_scale_2]).view(2, 1),
    )
    assert torch.equal(per_expert, expected.view(2, inter, hidden))
    with pytest.raises(AssertionError, match="weight_scale_2"):
        nvfp4.dequantize(torch.stack([weight] * 2), torch.stack([weight_scale] * 2), torch.ones(2))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_normal_error_bounds(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=gen)
    q = nvfp4.quantize(w)
    dq = q.dequantize()
    err = (w - dq).abs()
    step = _block_scale_per_element(q)  # [out, in] scale * global

    rel = torch.linalg.matrix_norm(w - dq) / torch.linalg.matrix_norm(w)
    assert rel < 0.12, f"relative Frobenius error {rel:.4f}"
    assert (err <= step * 1.0 + 1e-6).all()

    # Tighter: half the gap between neighbouring E2M1 values at each magnitude.
    x = (w / step).abs()
    half_gap = torch.where(x < 2, 0.25, torch.where(x <= 4, 0.5, 1.0))
    assert (err <= half_gap * step * (1 + 1e-6) + 1e-7).all()


def test_quantize_bfloat16_input_matches_float32() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    a, b = nvfp4.quantize(w), nvfp4.quantize(w.float())
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))


def test_rejects_bad_shapes_and_values() -> None:
    with pytest.raises(ValueError, match="in=24"):
        nvfp4.quantize(torch.ones(4, 24))
    with pytest.raises(ValueError, match="2-d"):
        nvfp4.quantize(torch.ones(2, 4, 32))
    with pytest.raises(ValueError, match="NaN or inf"):
        nvfp4.quantize(torch.tensor([[float("inf")] + [0.0] * 15]))
    with pytest.raises(AssertionError, match="covers"):
        nvfp4.dequantize(
            torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2).to(torch.float8_e4m3fn), torch.tensor(1.0)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    random = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    # On CUDA an overflowing fp8 cast gives NaN where the CPU saturates, so the subnormal-global
    # case checks the explicit saturation on the device where it matters.
    a = 2688 * 2.4 * 2.0**-149
    subnormal = torch.tensor([[a, -a / 2] + [0.0] * 14])
    for w in (random, subnormal):
        cpu, gpu = nvfp4.quantize(w), nvfp4.quantize(w.cuda())
        assert torch.equal(gpu.weight.cpu(), cpu.weight)
        assert torch.equal(gpu.weight_scale.cpu().view(torch.uint8), cpu.weight_scale.view(torch.uint8))
        assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())


def test_the_code_table_stays_on_the_cpu_when_first_imported_under_a_meta_device():
    """A model built under ``with torch.device("meta")`` may import this module first: its table
    must not become a meta tensor (every later dequantisation failed: 'no data')."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "with torch.device('meta'):\n"
        "    from ft.quant import nvfp4\n"
        "print(nvfp4.E2M1_VALUES.device)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "cpu"
