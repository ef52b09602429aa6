"""The elementwise work around the attention core as Triton kernels: per-head q/k RMSNorm with
rotary embedding before it (for a decode step, also the new k and v's cache write), and the sigmoid
output gate after it.

    qk_norm_rope:  q' = rope(norm_q(q)),  k' = rope(norm_k(k))       (one kernel for both)
        norm(x)   = x / sqrt(mean(x²) + eps) · w                     (w → 1 + w when zero-centred)
        rope(y)_i = y_i·cos(p·f_i) - y_{i+r/2}·sin(p·f_i)            i <  r/2
                    y_i·cos(p·f_i) + y_{i-r/2}·sin(p·f_i)            r/2 <= i < r
                    y_i                                              i >= r   (partial rotary)
        with f_i = inv_freq[i mod r/2] and p the token's position.
    qk_norm_rope_store:  the same, k' and v written to their paged-cache slots instead of returned
    sigmoid_gate:  out · sigmoid(gate)   (``gate_rounded``, which the attention kernels share)

q and gate are strided views of the qkv projection's output (with an output gate each query
head's rows are [q_h | gate_h]) and are read by strides, never copied. The rounding points are
those of the torch reference (``RMSNorm`` then ``RotaryEmbedding``, ``out * torch.sigmoid(g)``):
the norm rounds to the activations' dtype before the rotation, the angle p·f is an fp32 product,
sigmoid(g) is rounded before the product. FMA contraction is off so each product rounds as in
torch; what is left is fp32 reduction order and cos/sin to an ulp. Not here: the attention
itself, or choosing when a step stores through ``qk_norm_rope_store`` (the attention backend's
call, ``ft.attention.triton_paged``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.layers.pdl import pdl_args, wait_for_previous


@triton.jit
def _qk_norm_rope_kernel(
    q, k, v, q_w, k_w, positions, inv_freq, q_out, k_out, k_cache, v_cache, slots, eps,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_cb, s_cs, s_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, STORE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    # one program = HEADS heads of one token, numbered query heads first, then key heads
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    is_q = head < HQ
    kh = tl.maximum(head - HQ, 0)
    src = tl.where(is_q, q + t * s_qt + head * s_qh, k + t * s_kt + kh * s_kh)
    w = tl.where(is_q, q_w, k_w)
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    live = head < HQ + HKV
    mask = live & (d < D)
    xf = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 1)[:, None] / D + eps)
    wf = tl.load(w + d, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        wf = wf + 1.0
    y = (xf * inv * wf).to(q_out.dtype.element_ty).to(tl.float32)
    # the rotate-half partner of each rotated lane, normed the same way (a second, cached load)
    rot = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    pf = tl.load(src + partner, mask=live & rot, other=0.0).to(tl.float32)
    pw = tl.load(w + partner, mask=live & rot, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        pw = pw + 1.0
    py = (pf * inv * pw).to(q_out.dtype.element_ty).to(tl.float32)
    py = tl.where(d < half, -py, py)
    angle = tl.load(positions + t).to(tl.float32) * tl.load(inv_freq + d % half, mask=rot, other=0.0)
    y = tl.where(rot, y * tl.cos(angle) + py * tl.sin(angle), y).to(q_out.dtype.element_ty)
    if STORE:
        # a decode step: k' (rounded as the unfused k' was) and v go straight to the token's cache
        # slot, where ``store_kv`` would copy them; slot -1 is a padding row and writes nothing
        tl.store(q_out + (t * HQ + head) * D + d, y, mask=mask & is_q)
        slot = tl.load(slots + t)
        at = tl.maximum(slot, 0)  # a padding row's address, never written through
        row = (at // PAGE) * s_cb + (at % PAGE) * s_cs + kh * s_ch  # [HEADS, 1]
        kv = tl.where(slot >= 0, mask & (head >= HQ), False)  # a scalar flag via tl.where, as in triton_conv
        tl.store(k_cache + row + d, y.to(k_cache.dtype.element_ty), mask=kv)
        vt = tl.load(v + t * s_vt + kh * s_vh + d, mask=kv)
        tl.store(v_cache + row + d, vt.to(v_cache.dtype.element_ty), mask=kv)
    else:
        dst = tl.where(is_q, q_out + (t * HQ + head) * D, k_out + (t * HKV + kh) * D)
        tl.store(dst + d, y, mask=mask)


# Heads per program: one per program for decode-sized calls (the few programs spread over the SMs),
# eight for prefill, where a program per (token, head) made 36,864 one-warp programs for a 1k-token
# Qwen3-30B prompt (24 us for 9 MB on an H200 in the census).
PREFILL_TOKENS, PREFILL_HEADS = 64, 8


def _launch(positions, q, k, q_weight, k_weight, inv_freq, eps, zero_centered, q_out, k_out, store) -> None:
    """Checks the shared arguments, then launches; ``store`` is None or (v, kv_cache, slots)."""
    t, hq, d = q.shape
    hkv, rot = k.shape[1], 2 * inv_freq.shape[0]
    assert k.shape == (t, hkv, d), f"q {tuple(q.shape)} and k {tuple(k.shape)} do not pair"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k rows must be contiguous in the head dim"
    assert q_weight.shape == (d,) and k_weight.shape == (d,), f"norm weights must be [{d}]"
    assert positions.shape == (t,), f"positions {tuple(positions.shape)} must be [{t}]"
    assert inv_freq.dtype == torch.float32 and 2 <= rot <= d, f"inv_freq [{rot // 2}] fp32 for head dim {d}"
    assert k.dtype == q.dtype, f"q {q.dtype} and k {k.dtype}"
    if t == 0:
        return
    if store is None:  # the cache arguments are not read
        v, k_cache, v_cache, slots, cache_strides, page = k, k_out, k_out, positions, (0, 0, 0), 1
    else:
        v, kv_cache, slots = store
        k_cache, v_cache, page = kv_cache[0], kv_cache[1], kv_cache.shape[2]
        cache_strides = kv_cache.stride()[1:4]  # block, token, head
    heads = PREFILL_HEADS if t >= PREFILL_TOKENS else 1
    warps = (1 if d <= 128 else 2) * (4 if heads > 1 else 1)
    _qk_norm_rope_kernel[(t, triton.cdiv(hq + hkv, heads))](
        q, k, v, q_weight, k_weight, positions, inv_freq.contiguous(), q_out, k_out, k_cache, v_cache,
        slots, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_strides, HQ=hq, HKV=hkv, D=d, ROT=rot, ZERO_CENTERED=zero_centered, HEADS=heads,
        BLOCK_D=triton.next_power_of_2(d), PAGE=page, STORE=store is not None, num_warps=warps,
        enable_fp_fusion=False, **pdl_args(q),
    )  # fmt: skip


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    zero_centered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, Hq, d], k [T, Hkv, d] (views, last dim contiguous), weights [d],
    inv_freq [r/2] fp32 -> contiguous q', k' of the same shapes and dtype (CUDA, or the
    interpreter)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(positions, q, k, q_weight, k_weight, inv_freq, eps, zero_centered, q_out, k_out, None)
    return q_out, k_out


def qk_norm_rope_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    zero_centered: bool,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """``qk_norm_rope`` that writes k' and v [T, Hkv, d] (a view, last dim contiguous) at flat
    ``slots`` [T] of kv_cache [2, blocks, page, Hkv, d] instead of returning k' (slot -1: padding,
    not written) -> q'. The cache holds what ``qk_norm_rope`` then ``store_kv`` would leave."""
    _, _, page, hkv, d = kv_cache.shape
    assert v.shape == k.shape == (q.shape[0], hkv, d), f"k/v {tuple(v.shape)} do not fit cache {hkv}x{d}"
    assert v.stride(-1) == 1 and kv_cache.is_contiguous(), "v rows and the cache must be dense"
    assert slots.shape == (q.shape[0],) and page & (page - 1) == 0, f"slots [{q.shape[0]}], page {page}"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(
        positions, q, k, q_weight, k_weight, inv_freq, eps, zero_centered, q_out, q_out, (v, kv_cache, slots)
    )
    return q_out


@triton.jit
def gate_rounded(x, g):
    # x · sigmoid(g) for x already rounded to its output dtype: sigmoid(g) is rounded to that dtype
    # and the product taken in fp32, as ``out * torch.sigmoid(gate)`` rounds
    s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(x.dtype).to(tl.float32)
    return (x.to(tl.float32) * s).to(x.dtype)


@triton.jit
def _sigmoid_gate_kernel(
    x,
    g,
    out,
    s_xt,
    s_xh,
    s_gt,
    s_gh,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    xt = tl.load(x + t * s_xt + h * s_xh + d, mask=mask, other=0.0)
    gt = tl.load(g + t * s_gt + h * s_gh + d, mask=mask, other=0.0)
    tl.store(out + (t * H + h) * D + d, gate_rounded(xt, gt), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [T, H, d] (views, last dim contiguous) -> contiguous ``x · sigmoid(gate)`` (CUDA, or
    the interpreter)."""
    t, h, d = x.shape
    assert gate.shape == x.shape, f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}"
    assert x.stride(-1) == 1 and gate.stride(-1) == 1, "x and gate rows must be contiguous in the head dim"
    assert gate.dtype == x.dtype, f"x {x.dtype} and gate {gate.dtype}"
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t > 0:
        _sigmoid_gate_kernel[(t, h)](
            x, gate, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
            H=h, D=d, BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 128 else 2, **pdl_args(x),
        )  # fmt: skip
    return out
