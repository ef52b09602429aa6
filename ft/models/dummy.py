"""Generated weights (``--load-format dummy``): random values of a sensible scale for every
parameter, drawn on the parameter's own device, so any config can be run and benchmarked
without a checkpoint on disk (an 80B model initialises in seconds on a GPU)."""

from __future__ import annotations

import torch
from torch import nn

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    zero_centred = getattr(getattr(model, "config", None), "zero_centered_norm", False)
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        gen = generators.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if p.dtype == torch.uint8:  # NVFP4 codes: any byte is two valid codes
            p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=p.device, dtype=torch.int32))
        elif p.dtype == torch.float8_e4m3fn:  # NVFP4 block scales: powers of two around 8
            exps = torch.randint(1, 5, p.shape, generator=gen, device=p.device).float()
            p.copy_(torch.pow(2.0, exps))
        elif name.endswith("_global"):
            # a dequantised weight of about fan_in^-0.5: code (~2) * scale (~8) * global
            fan_in = model.config.hidden_size if "w13" in name else model.config.moe_intermediate_size
            p.fill_(fan_in**-0.5 / 16)
        elif p.dtype not in FLOATS:
            continue
        elif name.endswith("A_log"):
            p.uniform_(0.0, 2.7, generator=gen)
        elif name.endswith("norm.weight"):
            # GDN's gated norm is plain; the model's others follow its convention
            p.fill_(0.0 if zero_centred and "linear_attn.norm" not in name else 1.0)
        else:
            fan_in = p.shape[-1] if p.dim() >= 2 else 1
            p.normal_(0.0, 0.02 if p.dim() < 2 else fan_in**-0.5, generator=gen)
