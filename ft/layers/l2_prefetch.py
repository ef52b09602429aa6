"""Weights prefetched into L2 ahead of the projection that reads them (Hopper's bulk L2 prefetch).

A batch-1 decode step of the NVFP4 80B moves its 5.1 GB in ~1.2 ms of HBM time but takes ~2.9 ms
(docs/benchmarks.md, 2026-12-05): between the big projections run chains of small kernels (norms,
the router, the MoE GEMVs, the recurrence) bound by latency, during which HBM is mostly idle.
Their weights are known in advance. Each pre-norm kernel of a decode batch, first thing (before it
waits for the kernel before it), issues ``cp.async.bulk.prefetch.L2`` for the first megabytes of
the next big weight: the post-attention norm ``MB`` of the next layer's input projection (in_proj
or qkv_proj), read after this layer's MoE chain; the input norm ``OUT_MB`` of this layer's output
projection (out_proj or o_proj), read after the mixer's recurrence or attention (but asked for
just before the mixer's input projection, itself ~50 MB, streams through L2: timed apart).
A prefetch is a hint: it writes nothing, and a kernel that finds the lines gone reads HBM as before,
so results do not change; only time does.

Not the experiment of 2026-12-01 (docs/benchmarks.md 23:20 UTC, removed): there every dense GEMV
and router program prefetched its own weight rows before its PDL wait, one kernel ahead, while the
kernel before it read its own (often bandwidth-bound) weights: 8 to 48 MB a launch cost 2-8%, more
the more it fetched. Here the lines are asked for a chain of latency-bound kernels ahead, from
one program, so HBM fills them while it would idle; whether they survive the experts' traffic
through the 50 MB L2, and whether the queued prefetches slow that chain's own loads, is what the
probe below measures.

OFF (``MB`` 0) until a GPU run times it: ``tests/gpu/l2_prefetch_timings.py`` first (does a
prefetched weight make the GEMV after a latency-bound stretch faster, and how many MB survive the
experts' traffic through the 50 MB L2), then ``tests/gpu/decode_variants.py ...
ft.layers.l2_prefetch:MB=16`` etc. ``FT_L2_PREFETCH_MB`` / ``FT_L2_PREFETCH_OUT_MB`` set them for a
process and its ranks; ``EVICT_LAST`` (``FT_L2_PREFETCH_EVICT_LAST=1``) marks the norms' prefetched
lines evict-last (nothing demotes them after their GEMV). The MoE GEMV's gate/up launch prefetches
its experts' down rows the same way (``rows_args``; ``triton_moe_gemv.PREFETCH_DOWN``). GPUs from
sm_90 only (``takes``). Not here: prefill (compute-bound: nothing to gain). The offload backend's
lookahead runs the post-attention norm once more (``ft.models.decoder``): the same lines asked
for twice.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ft.layers.pdl import hopper

MB = int(os.environ.get("FT_L2_PREFETCH_MB", "0"))  # the next layer's input projection; 0: off
OUT_MB = int(os.environ.get("FT_L2_PREFETCH_OUT_MB", "0"))  # this layer's output projection; 0: off
EVICT_LAST = os.environ.get("FT_L2_PREFETCH_EVICT_LAST", "0") == "1"
MAX_ROWS = 16  # decode batches up to this many tokens prefetch (the GEMVs' sizes; larger ones are GEMMs)
CHUNK_BYTES = 1 << 16  # what one prefetch instruction asks for at most
CHUNK = tl.constexpr(CHUNK_BYTES)
ATTR = "l2_prefetch"  # a norm's attribute: its ``Target``


class Target(NamedTuple):
    weight: torch.Tensor  # a uint8 view of the weight
    next_layer: bool  # the next layer's input projection (``MB``), else this layer's output one (``OUT_MB``)


# one bulk prefetch of $2 bytes at $1 where $2 > 0 (addresses and sizes multiples of 16)
_PLAIN = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)
_LAST = tl.constexpr(
    "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0;"
    " createpolicy.fractional.L2::evict_last.b64 pol, 1.0;"
    " @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
)


@triton.jit
def prefetch_l2(base, nbytes, CHUNKS: tl.constexpr, LAST: tl.constexpr):
    # bytes [0, nbytes) of base (a uint8 pointer) as CHUNKS prefetches of up to CHUNK bytes, spread
    # over the program's threads; chunks past nbytes ask for nothing. CHUNKS at least the program's
    # threads (``chunks``): fewer, and Triton gives each chunk to several threads, each issuing it
    off = tl.arange(0, CHUNKS).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)
    if LAST:
        tl.inline_asm_elementwise(_LAST, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_PLAIN, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


_NONE = {"pf": None, "pf_bytes": 0, "PF_CHUNKS": 0, "PF_LAST": False}


def takes(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device may prefetch: a GPU with the instruction (sm_90 on)."""
    return hopper(t)


def chunks(nbytes: int, threads: int) -> int:
    """The ``CHUNKS`` of a prefetch of ``nbytes`` by a program of ``threads`` threads: a power of two
    covering the bytes, and at least one a thread, so that no chunk is asked for twice."""
    return max(triton.next_power_of_2(triton.cdiv(nbytes, CHUNK_BYTES)), threads)


def kernel_args(target: Target | None, rows: int, threads: int) -> dict:
    """A kernel's prefetch arguments: ``pf``, ``pf_bytes`` and the constexprs ``PF_CHUNKS`` (0: none)
    and ``PF_LAST``, for ``target`` ahead of a batch of ``rows`` tokens, from a program of ``threads``
    threads."""
    budget = 0 if target is None else MB if target.next_layer else OUT_MB
    if budget <= 0 or rows > MAX_ROWS or not takes(target.weight):
        return _NONE
    view = target.weight
    nbytes = min(view.numel(), budget << 20) & ~15  # the instruction's sizes are multiples of 16 bytes
    if nbytes == 0 or view.data_ptr() % 16:
        return _NONE
    return {"pf": view, "pf_bytes": nbytes, "PF_CHUNKS": chunks(nbytes, threads), "PF_LAST": EVICT_LAST}


def rows_args(bank: torch.Tensor, threads: int) -> tuple[torch.Tensor, int, int, int] | None:
    """For a bank [E, ...] whose experts are contiguous blocks: (its uint8 view, an expert's stride
    and bytes, the ``CHUNKS`` a prefetch of one expert by ``threads`` threads takes), or None when
    the instruction cannot take them (16-byte units and alignment, a GPU without it)."""
    per = bank[0].numel() * bank.element_size()
    stride = bank.stride(0) * bank.element_size()
    if not takes(bank) or not bank[0].is_contiguous() or per % 16 or stride % 16 or bank.data_ptr() % 16:
        return None
    return bank.view(torch.uint8), stride, per, chunks(per, threads)


def _weight(module, names: tuple[str, ...]) -> torch.Tensor | None:
    # the uint8 view of the first named child's 2-d weight (its device's: only a GPU's norm reads it)
    for name in names:
        w = getattr(getattr(module, name, None), "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous() and w.device.type != "meta":
            return w.detach().view(-1).view(torch.uint8)
    return None


def plan(layers) -> None:
    """Give each decoder layer's norms their targets (``ATTR``): the input norm this layer's output
    projection, the post-attention norm the next layer's input projection (the last layer's none).
    Layers without the two pre-norms or those projections are left out."""
    firsts, lasts = [], []
    for layer in layers:
        mixer = getattr(layer, getattr(layer, "mixer_name", ""), None)
        firsts.append(_weight(mixer, ("in_proj", "qkv_proj")))
        lasts.append(_weight(mixer, ("out_proj", "o_proj")))
    for i, layer in enumerate(layers):
        if hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm"):
            nxt = firsts[i + 1] if i + 1 < len(layers) else None
            setattr(layer.input_layernorm, ATTR, None if lasts[i] is None else Target(lasts[i], False))
            setattr(layer.post_attention_layernorm, ATTR, None if nxt is None else Target(nxt, True))
