"""NVIDIA ModelOpt's NVFP4 weight format: packing, quantisation and dequantisation in torch.

A projection is stored as three tensors, exactly as ModelOpt writes them:

- ``weight`` uint8 ``[out, in/2]``: two 4-bit E2M1 codes per byte, element ``2i`` in the low
  nibble and ``2i+1`` in the high nibble. Code bits 0-2 index the magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign.
- ``weight_scale`` float8_e4m3fn ``[out, in/16]``: one scale per block of 16 input elements.
- ``weight_scale_2`` fp32: the per-tensor ("global") scale.

and ``w = e2m1(code) * float(weight_scale) * weight_scale_2``.

This module is the reference: vectorised torch that runs on CPU and CUDA, used to quantise
experts at load time and to check kernels against. It is not a matmul kernel and not a loader;
it does not decide which layers are quantised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16  # input elements sharing one fp8 scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Indexed by code: bits 0-2 the magnitude, bit 3 the sign (so code 8 is -0.0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
    device="cpu",  # not the device of a `with torch.device(...)` around this module's first import
)

# Midpoints between adjacent magnitudes. A magnitude exactly on a midpoint rounds to the even
# code (round-half-to-even on the code index, as ModelOpt does): down at 0.25, 1.25, 2.5 and 5,
# up at 0.75, 1.75 and 3.5.
_MIDPOINTS_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_MIDPOINTS_TIE_UP = (0.75, 1.75, 3.5)


@dataclass(frozen=True)
class NVFP4Tensor:
    """One NVFP4 projection in checkpoint layout."""

    weight: torch.Tensor  # uint8 [out, in/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    weight_scale_2: torch.Tensor  # fp32 [] (or [out] when rows carry their own global)

    def __post_init__(self) -> None:
        _check_layout(self.weight, self.weight_scale)

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight, weight_scale, weight_scale_2), in the constructor's order."""
        return self.weight, self.weight_scale, self.weight_scale_2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., n]`` in 0..15 into bytes ``[..., n/2]``, element 2i low."""
    assert codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}"
    assert codes.shape[-1] % 2 == 0, f"last dim must be even to pack, got {tuple(codes.shape)}"
    # A code above 15 would silently corrupt its neighbour's nibble.
    assert not bool((codes > 15).any()), "codes must lie in 0..15"
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes`: bytes ``[..., n/2]`` to codes ``[..., n]``."""
    assert packed.dtype == torch.uint8, f"packed codes must be uint8, got {packed.dtype}"
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)  # [..., n]


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes of the E2M1 values nearest to fp32 ``x`` (already divided by its block scale)."""
    mag = x.abs()
    # The magnitude code counts the midpoints below it; strict vs non-strict comparison decides
    # which way each tie goes. Anything above 5 lands on code 7, which is the clamp to ±6.
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for m in _MIDPOINTS_TIE_DOWN:
        idx += (mag > m).to(torch.uint8)
    for m in _MIDPOINTS_TIE_UP:
        idx += (mag >= m).to(torch.uint8)
    # Like ModelOpt, a small negative that rounds to zero keeps its sign (code 8, -0.0).
    return idx | ((x < 0).to(torch.uint8) << 3)


def _div_or_zero(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # The safe denominator keeps 0/0 out of the discarded branch too, so no NaN is ever made.
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, 1.0), 0.0)


def global_scale_of(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor global scale, ``amax / (6 * 448)`` in fp32 (a 0-d tensor)."""
    return w.float().abs().amax() / (E2M1_MAX * E4M3_MAX)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantise ``w`` ``[out, in]`` to NVFP4 the way ModelOpt does, with one global scale.

    Expert banks quantise each projection on its own and stack the results; the global is
    per tensor, so stacking first would change the numbers. ``global_scale`` (from
    `global_scale_of` on the whole tensor) lets a tensor-parallel rank quantise only its slice
    of a projection and get exactly the bytes that slicing the whole quantised tensor would
    give, as long as the slice keeps whole 16-wide blocks.
    """
    if w.dim() != 2:
        raise ValueError(f"NVFP4 quantize expects a 2-d [out, in] weight, got shape {tuple(w.shape)}")
    out_features, in_features = w.shape
    if in_features % BLOCK != 0:
        raise ValueError(f"NVFP4 needs the input size to be a multiple of {BLOCK}, got in={in_features}")
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("NVFP4 quantize got a weight with NaN or inf")

    if global_scale is None:
        global_scale = global_scale_of(w)  # fp32 []
    global_scale = global_scale.to(device=w.device, dtype=torch.float32).reshape(())
    blocks = w.view(out_features, in_features // BLOCK, BLOCK)  # [out, in/16, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [out, in/16]

    # An all-zero tensor has global 0; its blocks get scale 0 instead of 0/0.
    scale = _div_or_zero(block_amax, E2M1_MAX * global_scale)
    # The ratio can exceed 448 when the global is an fp32 subnormal that lost precision, and
    # e4m3fn has no inf: whether an overflowing cast saturates or gives NaN has varied across
    # torch versions and devices, so saturate explicitly.
    scale_fp8 = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # [out, in/16]

    # A block whose fp8 scale is zero (all zeros, or underflow below the smallest subnormal)
    # quantises to code 0 rather than dividing by zero.
    block_denom = (scale_fp8.float() * global_scale).unsqueeze(-1)  # [out, in/16, 1]
    x = _div_or_zero(blocks, block_denom)  # [out, in/16, 16]
    codes = _round_to_e2m1(x).view(out_features, in_features)

    return NVFP4Tensor(
        weight=pack_codes(codes),  # [out, in/2]
        weight_scale=scale_fp8,
        weight_scale_2=global_scale.reshape(()),
    )


def _check_layout(weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    assert weight.dtype == torch.uint8, f"weight must be uint8, got {weight.dtype}"
    assert weight_scale.dtype == torch.float8_e4m3fn, (
        f"weight_scale must be float8_e4m3fn, got {weight_scale.dtype}"
    )
    assert weight.shape[:-1] == weight_scale.shape[:-1], (
        f"weight {tuple(weight.shape)} and weight_scale {tuple(weight_scale.shape)} disagree on leading dims"
    )
    assert weight.shape[-1] * 2 == weight_scale.shape[-1] * BLOCK, (
        f"weight {tuple(weight.shape)} holds {weight.shape[-1] * 2} inputs per row but "
        f"weight_scale {tuple(weight_scale.shape)} covers {weight_scale.shape[-1] * BLOCK}"
    )


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise NVFP4 ``[..., out, in/2]`` to ``[..., out, in]`` in ``dtype``.

    ``weight_scale_2`` is a scalar, or has one global per row (``[..., out]``, dims of size 1
    broadcast): an expert bank stacks gate and up, which ModelOpt quantised with different
    globals, so a single scalar cannot describe it.
    """
    _check_layout(weight, weight_scale)
    rows = weight.shape[:-1]
    g = weight_scale_2.float()
    # Same rank as the rows (or 0-d) so that a per-expert [E] can never be read as per-row [out].
    assert g.dim() == 0 or (g.dim() == len(rows) and all(a in (1, b) for a, b in zip(g.shape, rows))), (
        f"weight_scale_2 {tuple(g.shape)} must be a scalar or broadcast to rows {tuple(rows)}"
    )

    codes = unpack_codes(weight)  # [..., out, in]
    values = E2M1_VALUES.to(weight.device)[codes.int()]  # int32: half int64's temporary, same values
    values = values.unflatten(-1, (weight_scale.shape[-1], BLOCK))  # [..., out, in/16, 16]
    # e2m1 * e4m3 is exact in fp32, so the only rounding is the multiply by the global.
    w = values * weight_scale.float().unsqueeze(-1)
    w = w * (g if g.dim() == 0 else g[..., None, None])
    return w.flatten(-2).to(dtype)  # [..., out, in]
