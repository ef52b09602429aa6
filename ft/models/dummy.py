"""Generated weights (``--load-format dummy``): random values of a sensible scale for every
parameter, so any config can be run and benchmarked without a checkpoint on disk."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            continue
        fan_in = p.shape[-1] if p.dim() >= 2 else 1
        std = 0.02 if p.dim() < 2 else fan_in**-0.5
        cpu = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
        if name.endswith("A_log"):
            cpu = torch.empty(p.shape).uniform_(0, 2.7, generator=gen)
        p.copy_(cpu)
