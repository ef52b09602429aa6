"""Paged causal GQA attention on the GPU: wrappers around ``triton_kernels`` and the backend.

Same contract as ``torch_ref.TorchAttention``: write the new k/v at ``batch.slot_mapping`` (slot -1
is padding), then attend causally over each sequence's cached keys through ``batch.block_tables``;
with the layer's ``QKNormGate`` (``around``), norm and rotate q/k first and gate the output after.
Decode (one query per sequence) is split-KV / flash-decoding: each (sequence, kv head) is cut into
a fixed number of KV splits chosen from shapes, merged by a small combine kernel. It reads only
device tensors and shapes, so it can be captured in a CUDA graph; the extend path (prefill chunks
with prior context, mixed with decodes) plans its grid from the host query lengths.

With ``FUSED_DECODE`` a decode step given ``around`` runs as two launches (three with splits):
the q/k norm + rope kernel also writes k' and v to the cache (no ``store_kv``), and the gate is
applied where the attention output is written (no gate kernel). Bit for bit the unfused step.

It is not a general flash-attention: no sliding window, sinks or alibi; head_dim a power of two in
[16, 256]; page size a power of two >= 16; bf16, fp16 or fp32.
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING

import torch
import triton

from ft.attention.triton_kernels import combine_kernel, decode_kernel, extend_kernel, store_kv_kernel
from ft.forward_context import ForwardBatch
from ft.layers.pdl import pdl_args
from ft.layers.triton_rope import qk_norm_rope_store

if TYPE_CHECKING:
    from ft.layers.attention import QKNormGate

LOG2E = 1.4426950408889634
# Decode steps of QK-normed layers with the cache write inside the norm + rope kernel and the
# gate inside the attention kernels: no ``store_kv`` launch, and with an output gate (Qwen3-Next)
# no gate launch either, so two launches fewer an attention layer (one for Qwen3-30B).
# On since 2026-12-01: its GPU tests pass and, on the 24-layer Qwen3-Next (H200), batch-1 decode
# 456 -> 483 tok/s with the same greedy tokens (docs/benchmarks.md). FT_FUSED_ATTN_DECODE=0 turns
# it off for a process and the ranks it spawns.
FUSED_DECODE = os.environ.get("FT_FUSED_ATTN_DECODE", "1") != "0"
# The most KV splits a decode launch takes. A batch of B sequences runs B x kv heads x splits
# programs (splits: enough to fill the SMs twice), so Qwen3-Next's batch 1 (2 kv heads, 1 a rank at
# TP=2) ran 64 programs on an H200's 132 SMs when this was 32, each walking 1/32 of the context: too
# few to draw HBM's bandwidth at long contexts. The combine takes any count (COMBINE_CHUNK splits a
# load, the splits past a sequence's keys neither written nor read). 128 since 2026-12-05: one
# layer's decode attention at batch 1 (16 q / 2 kv heads of 256, a 262k-wide table, CUDA graph, an
# H200; docs/benchmarks.md) at 32 / 64 / 128 / 256 splits took 6.6 / 6.6 / 6.7 / 6.6 us at 1k
# tokens, 16.6 / 13.3 / 14.7 / 20.8 at 8k, 64.4 / 40.3 / 32.4 / 36.1 at 32k, 236.6 / 131.0 / 87.8 /
# 82.8 at 131k and 462.4 / 250.9 / 160.9 / 145.1 at 262k (128: 3.3 TB/s). The cap decides only where
# a launch runs two programs a split or fewer (batch 1; batch 2 at TP=2); above, the SMs set as many
# or fewer (batch 8 at 32k: 32 splits, 139 us; more were slower). FT_ATTN_MAX_SPLITS=N sets it for a
# process and the ranks it spawns (rounded down to a power of two).
MAX_SPLITS = int(os.environ.get("FT_ATTN_MAX_SPLITS", "128"))
COMBINE_CHUNK = 32  # splits the combine loads at once ([CHUNK, head_dim] fp32 in registers)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
    assert q.is_cuda and kv_cache.is_cuda, "TritonAttention needs CUDA tensors"
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q/k/v must be [T, H, d], got {q.shape}"
    two, _, page, hkv, d = kv_cache.shape
    assert two == 2, f"kv_cache must be [2, blocks, block_size, Hkv, d], got {tuple(kv_cache.shape)}"
    assert k.shape == v.shape == (q.shape[0], hkv, d), f"k/v {tuple(k.shape)} do not fit cache {hkv}x{d}"
    assert q.shape[-1] == d and q.shape[1] % hkv == 0, f"q heads {q.shape[1]} not a multiple of {hkv}"
    assert d in (16, 32, 64, 128, 256), f"head_dim {d} must be a power of two in [16, 256]"
    assert page >= 16 and page & (page - 1) == 0, f"block_size {page} must be a power of two >= 16"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Kernels index [T, H, d] tensors by their token and head strides; d must be dense."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    return kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)  # block, token, head


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k/v [T, Hkv, d] at flat slots [T] of kv_cache [2, blocks, page, Hkv, d]; -1 skips."""
    if k.shape[0] == 0:
        return
    k, v = _rows(k), _rows(v)
    _, _, page, hkv, d = kv_cache.shape
    store_kv_kernel[(k.shape[0],)](
        k, v, kv_cache[0], kv_cache[1], slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *_cache_strides(kv_cache), HKV=hkv, D=d, PAGE=page, HP=triton.next_power_of_2(hkv), **pdl_args(k),
    )  # fmt: skip


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, block_n: int) -> int:
    """Enough KV splits to fill the SMs twice, never more than the KV tiles a row can hold or
    ``MAX_SPLITS``."""
    programs = q.shape[0] * kv_cache.shape[3]
    want = triton.next_power_of_2(max(1, math.ceil(2 * _num_sms(q.device.index or 0) / programs)))
    tiles = triton.next_power_of_2(max(1, math.ceil(block_tables.shape[1] * kv_cache.shape[2] / block_n)))
    cap = 1 << (max(1, MAX_SPLITS).bit_length() - 1)  # a power of two, as the kernels need
    return max(1, min(want, tiles, cap))


def paged_decode(q, kv_cache, block_tables, seq_lens, scale: float, num_splits: int | None = None, gate=None):
    """One query per sequence: q [B, Hq, d], seq_lens [B] (with the new token) -> [B, Hq, d],
    times sigmoid(gate) for a gate [B, Hq, d] (a view, last dim contiguous)."""
    q = _rows(q)
    bsz, hq, d = q.shape
    if gate is not None:
        assert gate.shape == q.shape and gate.dtype == q.dtype, f"gate {tuple(gate.shape)} {gate.dtype}"
        assert gate.stride(-1) == 1, "gate rows must be contiguous in the head dim"
    hkv = kv_cache.shape[3]
    rep = hq // hkv
    block_n = 64 if d <= 128 else 32
    splits = num_splits or num_splits_for(q, kv_cache, block_tables, block_n)
    assert splits & (splits - 1) == 0, f"num_splits {splits} must be a power of two"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    part_o = part_lse = out  # unused with one split
    if splits > 1:
        part_o = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, hq, splits, dtype=torch.float32, device=q.device)
    g, g_strides = (out, (0, 0)) if gate is None else (gate, (gate.stride(0), gate.stride(1)))
    decode_kernel[(bsz, hkv, splits)](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, part_o, part_lse, g, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_strides(kv_cache),
        block_tables.stride(0), *g_strides, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=d,
        PAGE=kv_cache.shape[2], BLOCK_N=block_n, SPLITS=splits, PREC=_prec(q.dtype),
        GATE=gate is not None and splits == 1, num_warps=4, num_stages=2, **pdl_args(q),
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(bsz, hq)](
            part_o, part_lse, seq_lens, out, g, out.stride(0), out.stride(1), *g_strides, HQ=hq, D=d,
            SPLITS=splits, BLOCK_N=block_n, GATE=gate is not None, CHUNK=min(splits, COMBINE_CHUNK),
            num_warps=4, **pdl_args(out),
        )  # fmt: skip
    return out


# FT_ATTN_EXTEND_TILES=BM,BN,WARPS,STAGES sets the 16-bit, 128-or-wider heads' extend tiles for a
# process and the ranks it spawns: what a sweep's best (tests/gpu/config_sweep.py extend) is run with
# in the engine before it is written below
EXTEND_TILES = tuple(int(v) for v in os.environ.get("FT_ATTN_EXTEND_TILES", "").split(",") if v) or None


def _extend_config(dtype: torch.dtype, d: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the extend kernel. 16-bit heads of 128 or more
    take 128 (or, for short queries, 64) query rows against 64 keys, 2 stages: on an H200
    (2026-11-30, 16 q / 2 kv heads of 256, causal, one sequence) 1.60 ms for 8,000 tokens (327
    TFLOPS) against 7.37 ms with 32 x 32, and 0.090 against 0.201 ms for 1,024; torch's varlen_attn
    (FlashAttention 2) took 1.82 and 0.082 ms. Heads of 128 (Qwen3-30B) were not swept: its 8k
    prefill spends half its kernel time here (``config_sweep.py extend``). fp32 and smaller heads
    keep the untimed smaller tiles."""
    if dtype != torch.float32 and d >= 128:
        if EXTEND_TILES is not None:
            assert len(EXTEND_TILES) == 4, f"FT_ATTN_EXTEND_TILES={EXTEND_TILES}: BM,BN,WARPS,STAGES"
            return EXTEND_TILES
        return (128 if max_query_len >= 128 else 64), 64, 8, 2
    block_m = 64 if d <= 128 and dtype != torch.float32 else 32
    return block_m, (64 if d <= 64 else 32), (8 if d >= 128 else 4), 2


# The extend kernel in Gluon (``gluon_extend``: wgmma from shared memory without spilling, the
# causal select only on the diagonal tiles, heaviest query blocks first) where it fits a call
# (``gluon_extend.supports``: Hopper, 16-bit heads of 64 to 256). On since 2026-12-04: on an H200
# at Qwen3-Next's heads (16 q / 2 kv of 256) 8,000 queries 1,562 -> 1,356 us, a 32k prompt's second
# 16k chunk 16,874 -> 14,875 us (391 -> 444 TFLOP/s, tests/gpu/extend_timings.py); the offloaded bf16
# 80B's 32k prefill streams at 86% of the link (84.7% before; docs/benchmarks.md).
# FT_ATTN_GLUON_EXTEND=0 turns it off for a process and the ranks it spawns.
GLUON_EXTEND = os.environ.get("FT_ATTN_GLUON_EXTEND", "1") != "0"


def paged_extend(q, kv_cache, block_tables, cu_seqlens, context_lens, max_query_len: int, scale: float):
    """Queries [T, Hq, d] after context_lens [B] cached tokens; sequence i owns rows cu_seqlens[i:i+2]."""
    q = _rows(q)
    if GLUON_EXTEND:
        from ft.attention import gluon_extend

        if gluon_extend.supports(q, kv_cache, block_tables):
            return gluon_extend.launch(q, kv_cache, block_tables, cu_seqlens, context_lens, max_query_len,
                                       scale * LOG2E, _cache_strides(kv_cache))  # fmt: skip
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    block_m, block_n, warps, stages = _extend_config(q.dtype, d, max_query_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(max_query_len, block_m), cu_seqlens.shape[0] - 1, hq)
    extend_kernel[grid](
        q, kv_cache[0], kv_cache[1], block_tables, cu_seqlens, context_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_strides(kv_cache),
        block_tables.stride(0), REP=hq // hkv, D=d, PAGE=kv_cache.shape[2], BLOCK_M=block_m,
        BLOCK_N=block_n, PREC=_prec(q.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def fused_decode(
    q, k, v, kv_cache, batch: ForwardBatch, scale: float, around: QKNormGate, num_splits: int | None = None
) -> torch.Tensor:
    """A decode step of a QK-normed layer from the raw q/k/v views: norms, rope and the cache
    write in one kernel, then attention with the gate applied as it is written (no device check:
    the interpreter runs it on CPU tensors)."""
    qn, kn = around.q_norm, around.k_norm
    q = qk_norm_rope_store(
        around.positions, q, k, v, qn.weight, kn.weight, around.rotary.inv_freq.float(), qn.eps,
        qn.zero_centered, kv_cache, batch.slot_mapping,
    )  # fmt: skip
    return paged_decode(q, kv_cache, batch.block_tables, batch.seq_lens, scale, num_splits, around.gate)


class TritonAttention:
    name = "triton"
    graph_safe = True  # decode reads device tensors only

    def forward(
        self, q, k, v, kv_cache, batch: ForwardBatch, scale: float, around: QKNormGate | None = None
    ) -> torch.Tensor:
        decode = q.shape[0] == batch.seq_lens.shape[0]  # one token per sequence, told from shapes alone
        if around is not None:
            if decode and FUSED_DECODE and around.rotary.rotary_dim > 0:
                _check(q, k, v, kv_cache)
                return fused_decode(q, k, v, kv_cache, batch, scale, around)
            q, k = around.norm_rope(q, k)
            return around.apply_gate(self.forward(q, k, v, kv_cache, batch, scale))
        _check(q, k, v, kv_cache)
        store_kv(kv_cache, k, v, batch.slot_mapping)
        if decode:
            return paged_decode(q, kv_cache, batch.block_tables, batch.seq_lens, scale)
        max_q = max(batch.query_lens_cpu)
        return paged_extend(
            q, kv_cache, batch.block_tables, batch.cu_seqlens, batch.context_lens, max_q, scale
        )
