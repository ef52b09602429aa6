"""NVFP4 expert bank: ModelOpt's packed experts, stacked per layer and split over TP ranks.

On each rank, with Ip = I/P (gate rows then up rows in the w13 tensors):

    w13         uint8          [E, 2·Ip, H/2]    two E2M1 codes a byte, element 2i low
    w13_scale   float8_e4m3fn  [E, 2·Ip, H/16]   one scale per 16 inputs
    w13_global  fp32           [E, 2·Ip]         per row: gate and up keep their own globals
    w2          uint8          [E, H, Ip/2]      this rank's down columns
    w2_scale    float8_e4m3fn  [E, H, Ip/16]
    w2_global   fp32           [E, H]            down's one global, repeated over its rows
    input_scale fp32           [E, 3]            ModelOpt's activation scales of gate, up, down

and ``w = e2m1(code) · scale · global`` row by row. A rank's down columns must be whole scale
blocks, so Ip must be a multiple of 16.

Two sources fill the same bank: a ModelOpt checkpoint (``experts.{e}.{proj}.weight`` uint8,
``.weight_scale`` fp8, ``.weight_scale_2`` and ``.input_scale`` fp32 scalars), or a bf16 one
quantised while loading (``--quantize-experts nvfp4``), where each projection's global comes
from the whole projection (ModelOpt's amax / (6·448)) and only this rank's slice is quantised and
kept. Activation scales are validated and kept but unused: the kernels are W4A16.
"""

from __future__ import annotations

import torch

from ft.layers.loading import new_param
from ft.models.checkpoint import FLOAT_DTYPES, CheckpointTensor
from ft.moe.banks import FLOAT_SOURCES, PROJECTIONS, ExpertBank, weight_parts
from ft.quant import nvfp4
from ft.quant.nvfp4 import BLOCK, NVFP4Tensor

# (bank tensor, the projections it holds, ModelOpt's suffix): the checkpoint-to-bank mapping
MODELOPT_PARTS = (
    ("w13", (0, 1), "weight"),
    ("w13_scale", (0, 1), "weight_scale"),
    ("w13_global", (0, 1), "weight_scale_2"),
    ("w2", (2,), "weight"),
    ("w2_scale", (2,), "weight_scale"),
    ("w2_global", (2,), "weight_scale_2"),
    ("input_scale", (0, 1, 2), "input_scale"),
)
PACKED = {"weight": (torch.uint8, 2), "weight_scale": (torch.float8_e4m3fn, BLOCK)}  # dtype, inputs each


class NVFP4ExpertBank(ExpertBank):
    format = "nvfp4"
    expert_tensors = ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, checkpoint_format: str = "nvfp4"
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        e, h, local = num_experts, hidden_size, self.local_inter
        if h % BLOCK:
            raise ValueError(
                f"NVFP4 experts: hidden_size {h} must be a multiple of {BLOCK} (one fp8 scale block); "
                "this model's experts cannot be NVFP4 at any tp size"
            )
        if local % BLOCK:
            raise ValueError(
                f"NVFP4 experts: moe_intermediate_size {intermediate_size} over {self.tp.size} tp ranks "
                f"gives {local} rows per rank, which must be a multiple of {BLOCK} (one fp8 scale "
                f"block), so choose a tp size that keeps I/P a multiple of {BLOCK}"
            )
        fp8, fp32 = torch.float8_e4m3fn, torch.float32
        with self.allocating():
            self.w13 = new_param(e, 2 * local, h // 2, dtype=torch.uint8)
            self.w13_scale = new_param(e, 2 * local, h // BLOCK, dtype=fp8)
            self.w13_global = new_param(e, 2 * local, dtype=fp32)
            self.w2 = new_param(e, h, local // 2, dtype=torch.uint8)
            self.w2_scale = new_param(e, h, local // BLOCK, dtype=fp8)
            self.w2_global = new_param(e, h, dtype=fp32)
        # what `ft info` counts as parameters: two weights a code byte, none in the scales
        for p in (self.w13, self.w2):
            p.logical_numel = 2 * p.numel()
        for p in (self.w13_scale, self.w13_global, self.w2_scale, self.w2_global):
            p.logical_numel = 0
        if checkpoint_format == "nvfp4":
            self.input_scale = new_param(e, 3, dtype=fp32)
            self.input_scale.logical_numel = 0
            self._expect_modelopt()
        elif checkpoint_format in FLOAT_SOURCES:  # quantised at load
            self._expect_bf16()
        else:
            raise ValueError(f"an NVFP4 expert bank cannot load {checkpoint_format!r} experts")
        self.select_kernel()

    def kernel_weights(self, tensors=None) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        t = tensors if tensors is not None else self.expert_weights()
        return (
            NVFP4Tensor(t["w13"], t["w13_scale"], t["w13_global"]),
            NVFP4Tensor(t["w2"], t["w2_scale"], t["w2_global"]),
        )

    # ---- a ModelOpt checkpoint: every suffix loads into its own tensor
    def _expect_modelopt(self) -> None:
        for name, projs, suffix in MODELOPT_PARTS:
            param = getattr(self, name)
            param.checkpoint_parts = [
                (f"{e}.{PROJECTIONS[p]}.{suffix}", (e, p, suffix))
                for e in range(self.num_experts)
                for p in projs
            ]
            param.weight_loader = self._load_modelopt

    def _load_modelopt(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id) -> None:
        e, proj, suffix = shard_id
        if suffix == "input_scale":
            param.data[e, proj] = _scalar(ckpt)
            return
        if suffix == "weight_scale_2":
            self.rows(param, e, proj).fill_(_scalar(ckpt))
            return
        dtype, per = PACKED[suffix]
        ckpt.expect_dtype((dtype,))
        inter, hidden = self.intermediate_size, self.hidden_size
        start, local = self.inter_start, self.local_inter
        if proj == 2:  # down: this rank's columns, packed or blocked along I
            ckpt.expect_shape((hidden, inter // per))
            part = ckpt.narrow(1, start // per, local // per)
        else:  # gate / up: this rank's rows, H packed or blocked
            ckpt.expect_shape((inter, hidden // per))
            part = ckpt.narrow(0, start, local)
        if suffix == "weight_scale" and not bool((part.float() >= 0).all()):  # e4m3fn has NaN, no inf
            raise ckpt.error("has NaN or negative block scales; they must be finite and >= 0")
        self.rows(param, e, proj).copy_(part)

    # ---- a bf16 checkpoint quantised at load: one tensor fills codes, scales and global
    def _expect_bf16(self) -> None:
        self.w13.checkpoint_parts, self.w2.checkpoint_parts = weight_parts(self.num_experts)
        for param in (self.w13, self.w2):
            param.weight_loader = self._quantize_on_load
        for param in (self.w13_scale, self.w13_global, self.w2_scale, self.w2_global):
            param.checkpoint_parts = []  # filled with their codes

    def _quantize_on_load(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id) -> None:
        e, proj = shard_id
        inter, hidden = self.intermediate_size, self.hidden_size
        ckpt.expect_shape((hidden, inter) if proj == 2 else (inter, hidden))
        ckpt.expect_dtype(FLOAT_DTYPES)
        # The whole projection is read because its amax sets the global; only the slice is kept.
        w = ckpt.read().to(self.device)  # quantised where the model runs, kept wherever the bank is
        if not bool(torch.isfinite(w).all()):  # NVFP4 has no NaN or inf to keep it as
            raise ckpt.error("has NaN or inf values, which NVFP4 cannot quantise")
        mine = w.narrow(1 if proj == 2 else 0, self.inter_start, self.local_inter)
        q = nvfp4.quantize(mine, nvfp4.global_scale_of(w))
        names = ("w2", "w2_scale", "w2_global") if proj == 2 else ("w13", "w13_scale", "w13_global")
        codes, scales, globals_ = (getattr(self, n) for n in names)
        self.rows(codes, e, proj).copy_(q.weight)
        self.rows(scales, e, proj).copy_(q.weight_scale)
        self.rows(globals_, e, proj).fill_(q.weight_scale_2)


def _scalar(ckpt: CheckpointTensor) -> float:
    """A ModelOpt fp32 scale: 0-d (or [1]), finite and not negative."""
    if ckpt.shape not in ((), (1,)):
        raise ckpt.error(f"shape {list(ckpt.shape)}, expected a scalar ([] or [1])")
    ckpt.expect_dtype((torch.float32,))
    value = float(ckpt.read().reshape(()))
    if not (value >= 0.0 and value != float("inf")):
        raise ckpt.error(f"scale {value} must be finite and >= 0")
    return value
