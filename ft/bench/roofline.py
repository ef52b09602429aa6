"""The decode roofline: the bytes one decode step must move, over HBM bandwidth measured now.

A decode step reads every dense weight once (attention / GDN projections, shared experts,
routers, norms, lm_head), the distinct routed experts the batch activates (for B tokens routed
uniformly to k of E experts, E·(1 − (1 − k/E)^B) per layer), each sequence's KV cache, and reads
and writes each sequence's GDN state. Its time can be no less than those bytes over the memory
bandwidth; ``ft bench`` divides what it achieved by that limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from ft.models.config import ModelConfig


@dataclass(frozen=True)
class StepBytes:
    dense: int
    lm_head: int
    experts: int
    kv: int
    state: int

    @property
    def total(self) -> int:
        return self.dense + self.lm_head + self.experts + self.kv + self.state


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def decode_step_bytes(
    model: nn.Module, mc: ModelConfig, batch: int, context: int, act_bytes: int = 2
) -> StepBytes:
    """Bytes one rank moves in a decode step of ``batch`` sequences of ``context`` cached tokens.

    ``model`` may live on the meta device: only shapes are read. ``act_bytes`` is the KV dtype size.
    """
    dense = lm_head = experts_total = 0
    banks = [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "weight_bytes")]
    bank_params = {id(p) for b in banks for p in b.parameters()}
    for name, p in model.named_parameters():
        if id(p) in bank_params or "embed_tokens" in name:
            continue
        if name.startswith("lm_head"):
            lm_head += _bytes([p])
        else:
            dense += _bytes([p])
    if mc.tie_word_embeddings:
        lm_head = _bytes([model.lm_head.weight])
    for bank in banks:
        e, k = mc.num_experts, mc.num_experts_per_tok
        distinct = e * (1 - (1 - k / e) ** batch)
        experts_total += int(bank.weight_bytes() / e * distinct)
    kv = state = 0
    for m in model.modules():
        if hasattr(m, "cache_shape"):
            h, d = m.cache_shape()
            kv += 2 * h * d * act_bytes * context * batch
        if hasattr(m, "state_shapes"):
            conv, ssm = m.state_shapes()
            state += 2 * (math.prod(conv) * act_bytes + math.prod(ssm) * 4) * batch
    return StepBytes(dense, lm_head, experts_total, kv, state)


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    if device.type == "cpu":
        nbytes = min(nbytes, 1 << 27)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * nbytes * repeats / seconds
