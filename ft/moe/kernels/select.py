"""The MoE kernel selection table: each kernel says what it can run, the first that fits wins.

``select_moe_kernel(fmt, device, tp_size, dtype=...)`` is called once at start-up (by the expert
bank). When nothing fits, ``KernelSelectionError`` lists every candidate with the reason it was
refused, so a missing wheel or an old GPU reads as such instead of as a wrong answer later.
Kernels share the signature ``kernel(x, w13, w2, weights, ids, batch_tokens=None, into=None,
batch_experts=None) -> [T, H]`` of ``torch_ref.fused_moe_ref`` (``batch_tokens``: when x is part
of a batch, as the offload backend's streamed pairs are, the kernel takes the path, GEMV or MMA,
and the tiles it takes for that batch; ``batch_experts``: the model's experts, when the bank's
rows are others, a cache's slots or a staging buffer);
for NVFP4 banks ``w13``/``w2`` are ``ft.quant.nvfp4.NVFP4Tensor`` stacks (codes, scales, per-row
globals).
This module does not load weights or decide where they live (that is the bank and the backend).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


class KernelSelectionError(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelSpec:
    name: str
    target: str  # "module:function", imported only when the kernel is chosen
    formats: tuple[str, ...]
    device_types: tuple[str, ...]  # "any" matches every device
    min_capability: tuple[int, int] | None = None  # CUDA compute capability
    tp_ok: bool = True
    needs: tuple[str, ...] = ()  # importable modules it depends on
    dtypes: tuple[torch.dtype, ...] | None = None  # activation dtypes; None: any
    graph_safe: bool = False  # never synchronises with the host, so a CUDA graph can capture it

    def refusal(
        self, fmt: str, device: torch.device, tp_size: int, dtype: torch.dtype | None = None
    ) -> str | None:
        """Why this kernel cannot run here, or None when it can (``dtype`` None: not checked)."""
        if fmt not in self.formats:
            return f"format {fmt!r} not in {self.formats}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"activation dtype {dtype} not in {self.dtypes}"
        if "any" not in self.device_types and device.type not in self.device_types:
            return f"device {device.type!r} not in {self.device_types}"
        if self.min_capability is not None:
            cap = torch.cuda.get_device_capability(device)
            if cap < self.min_capability:
                return f"compute capability {cap} < {self.min_capability}"
        if tp_size > 1 and not self.tp_ok:
            return f"does not support tensor parallelism (tp_size={tp_size})"
        for mod in self.needs:
            try:
                importlib.import_module(mod)
            except ImportError as exc:
                return f"cannot import {mod}: {exc}"
        return None

    def load(self) -> Callable:
        module, func = self.target.split(":")
        return getattr(importlib.import_module(module), func)


MOE_KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec(
        name="triton-bf16",
        target="ft.moe.kernels.triton_moe:fused_moe_triton",
        formats=("bf16",),
        device_types=("cuda",),
        min_capability=(8, 0),
        needs=("triton",),
        dtypes=(torch.bfloat16, torch.float16),
        graph_safe=True,
    ),
    KernelSpec(
        name="triton-w4a16",
        target="ft.moe.kernels.triton_w4a16:fused_moe_w4a16",
        formats=("nvfp4",),
        device_types=("cuda",),
        min_capability=(8, 0),  # codes and fp8 scales are decoded with integer ops, no fp8 units
        needs=("triton",),
        dtypes=(torch.bfloat16,),
        graph_safe=True,
    ),
    KernelSpec(
        name="torch-ref",
        target="ft.moe.kernels.torch_ref:fused_moe_ref",
        formats=("bf16",),
        device_types=("any",),
    ),
    KernelSpec(
        name="torch-nvfp4",
        target="ft.moe.kernels.nvfp4_torch:fused_moe_nvfp4_ref",
        formats=("nvfp4",),
        device_types=("any",),
    ),
)


def kernel_spec(name: str, candidates: tuple[KernelSpec, ...] = MOE_KERNELS) -> KernelSpec:
    return next(s for s in candidates if s.name == name)


def select_moe_kernel(
    fmt: str,
    device: torch.device | str,
    tp_size: int = 1,
    candidates: tuple[KernelSpec, ...] = MOE_KERNELS,
    dtype: torch.dtype | None = None,
) -> tuple[str, Callable]:
    """The first candidate that fits (format, device, TP, activation dtype) as (name, kernel)."""
    device = torch.device(device)
    refused = []
    for spec in candidates:
        reason = spec.refusal(fmt, device, tp_size, dtype)
        if reason is None:
            return spec.name, spec.load()
        refused.append(f"  {spec.name}: {reason}")
    raise KernelSelectionError(
        f"no MoE kernel for format={fmt!r} device={device} tp_size={tp_size} dtype={dtype}:\n"
        + "\n".join(refused)
    )
