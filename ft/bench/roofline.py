"""The rooflines ``ft bench`` measures against: a decode step's bytes over HBM bandwidth, a
prefill's FLOPs over the matmul rate, both rates measured now.

A decode step reads every dense weight once (attention / GDN projections, shared experts,
routers, norms, lm_head), the distinct routed experts the batch activates (for B tokens routed
uniformly to k of E experts, E·(1 − (1 − k/E)^B) per layer), each sequence's KV cache (what each
attention layer says a query must read, ``decode_cache_reads``: a sparse one its ``max_keys`` keys
and its indexer's block summaries), and reads and writes each sequence's GDN state. Its time can
be no less than those bytes over the memory bandwidth.

A prefill of L tokens multiplies every token by every dense matrix and by its k routed experts'
(2 FLOPs a weight), attends each query to the keys before it (QK^T and PV: 4·d FLOPs a head and a
key; a sparse layer's ``max_keys`` at most), runs the GDN recurrence (output q·S and update
S += k^T(v − k·S): 6·dk·dv a value head), and computes one row of logits. Its time can be no less
than those FLOPs over the dense bf16 matmul rate. Lookup tables (embeddings, qwen4_exp's n-gram
table: ``lookup``) are read a row a token in either, so neither counts them.
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


def _is_bank(m: nn.Module) -> bool:
    """An expert bank (bf16 or NVFP4): its experts are counted as routed, not as dense weights."""
    return hasattr(m, "num_experts") and hasattr(m, "weight_bytes")


def _dense_params(model: nn.Module):
    """(name, parameter) of the weights read whole: not an expert bank's, not a lookup table's."""
    skip = set()
    for m in model.modules():
        if _is_bank(m) or getattr(m, "lookup", False):
            skip.update(id(p) for p in m.parameters())
    return [(n, p) for n, p in model.named_parameters() if id(p) not in skip]


def decode_step_bytes(
    model: nn.Module, mc: ModelConfig, batch: int, context: int, act_bytes: int = 2
) -> StepBytes:
    """Bytes one rank moves in a decode step of ``batch`` sequences of ``context`` cached tokens.

    ``model`` may live on the meta device: only shapes are read. ``act_bytes`` is the KV dtype size.
    """
    dense = lm_head = experts_total = 0
    banks = [m for m in model.modules() if _is_bank(m)]
    for name, p in _dense_params(model):
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
        if hasattr(m, "decode_cache_reads"):
            kv += m.decode_cache_reads(context) * act_bytes * batch
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
    return 2 * nbytes * repeats / _seconds(lambda: dst.copy_(src), device, repeats)


def _seconds(run, device: torch.device, repeats: int) -> float:
    """Seconds ``repeats`` calls of ``run`` take after one untimed call (device time on a GPU)."""
    run()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        return time.perf_counter() - t0
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass(frozen=True)
class PrefillFlops:
    dense: float  # every token times every dense matrix (projections, routers, shared experts, convs)
    experts: float  # every token times its k routed experts' matrices
    attention: float  # QK^T and PV over the keys each query sees
    recurrent: float  # the GDN state's output and update
    lm_head: float  # the last token's logits

    @property
    def total(self) -> float:
        return self.dense + self.experts + self.attention + self.recurrent + self.lm_head


def prefill_flops(model: nn.Module, mc: ModelConfig, length: int) -> PrefillFlops:
    """FLOPs one rank does at least to prefill one prompt of ``length`` tokens (from scratch, its
    last token's logits). ``model`` may live on the meta device: only shapes are read."""
    dense = lm_head = 0.0
    for name, p in _dense_params(model):
        if p.dim() < 2:  # norms' weights, biases, A_log: elementwise
            continue
        if name.startswith("lm_head"):
            lm_head = 2.0 * p.numel()
        else:
            dense += 2.0 * p.numel() * length
    if mc.tie_word_embeddings:
        lm_head = 2.0 * model.lm_head.weight.numel()
    experts = attention = recurrent = 0.0
    for m in model.modules():
        if _is_bank(m):  # gate, up and down a routed pair
            experts += 2.0 * 3 * m.hidden_size * m.local_inter * mc.num_experts_per_tok * length
        if hasattr(m, "cache_shape") and hasattr(m, "num_heads"):
            cap = getattr(m, "max_keys", None) or length
            full = min(length, cap)  # the queries that see every key before them, then cap keys each
            keys = full * (full + 1) / 2 + (length - full) * cap
            attention += 4.0 * m.num_heads * m.head_dim * keys
        if hasattr(m, "state_shapes"):
            hv, dk, dv = m.state_shapes()[1]
            recurrent += 6.0 * hv * dk * dv * length
    return PrefillFlops(dense, experts, attention, recurrent, lm_head)


def measure_matmul_rate(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """FLOP per second of a dense n x n x n matmul: bf16 on a GPU, fp32 (n = 1024) on the CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        n, repeats = min(n, 1024), min(repeats, 3)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2.0 * n**3 * repeats / _seconds(lambda: a @ b, device, repeats)
