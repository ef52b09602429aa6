"""Generated weights (``--load-format dummy``): random values of a sensible scale for every
parameter, drawn on the parameter's own device, so any config can be run and benchmarked
without a checkpoint on disk (an 80B model initialises in seconds on a GPU).

Experts that an offloading backend placed (a host store, and the cache slots of static experts)
are drawn on the model's device one whole bank tensor at a time, contiguous, and copied to where
each expert lives: the values are the resident backend's, bit for bit, and drawing on a GPU is
much faster than drawing hundreds of GB on the CPU.

Random routers route uniformly, the worst case for an expert cache. ``routing_skew`` S > 0 gives
each router a Zipf-like expert popularity: the experts of a layer are ranked in a random order
and expert rank r's router row is scaled by (r + 1)^(-S/4), so its logits spread wider and it
wins the top-k more often. Measured with random inputs (E = 512, k = 10), S = 0.5 and S = 1 put
30% and 52% of the selections on the top 10% of experts, close to Zipf(0.5) and Zipf(1) (29%,
66%); the fit loosens above S = 1.
"""

from __future__ import annotations

import torch
from torch import nn

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def init_dummy_weights(
    model: nn.Module, seed: int = 0, routing_skew: float = 0.0, device: torch.device | None = None
) -> None:
    zero_centred = getattr(getattr(model, "config", None), "zero_centered_norm", False)
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        placed = getattr(p, "placed", None)  # ft.moe.backends.placement
        if placed is not None:
            dev = device or p.device
            gen = generators.setdefault(dev, torch.Generator(device=dev).manual_seed(seed))
            tmp = torch.empty(p.shape, dtype=p.dtype, device=dev)
            _fill(tmp, name, model, gen, zero_centred)
            placed.write(tmp)
            continue
        gen = generators.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        _fill(p, name, model, gen, zero_centred)
    if routing_skew > 0:
        skew_routers(model, routing_skew, seed)


def skew_routers(model: nn.Module, skew: float, seed: int) -> None:
    from ft.moe.router import TopKRouter

    gen = torch.Generator().manual_seed(seed + 1)
    for m in model.modules():
        if isinstance(m, TopKRouter):
            experts = m.weight[: m.weight.shape[0] - m.shared_gate]  # not the shared gate's row
            rank = torch.randperm(experts.shape[0], generator=gen)  # expert -> popularity rank
            scale = (rank.double() + 1) ** (-skew / 4)
            experts.mul_(scale.to(m.weight.device, m.weight.dtype)[:, None])


def _fill(p: torch.Tensor, name: str, model: nn.Module, gen: torch.Generator, zero_centred: bool) -> None:
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
        return
    elif name.endswith("A_log"):
        p.uniform_(0.0, 2.7, generator=gen)
    elif name.endswith("norm.weight"):
        # GDN's gated norm is plain; the model's others follow its convention
        p.fill_(0.0 if zero_centred and "linear_attn.norm" not in name else 1.0)
    else:
        fan_in = p.shape[-1] if p.dim() >= 2 else 1
        p.normal_(0.0, 0.02 if p.dim() < 2 else fan_in**-0.5, generator=gen)
