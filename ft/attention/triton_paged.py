"""Paged causal GQA attention in Triton: KV store, split-KV decode, and prefill/extend.

Same contract as ``torch_ref.TorchAttention``: write the new k/v at ``batch.slot_mapping`` (slot -1
is padding), then attend causally over each sequence's cached keys through ``batch.block_tables``.
Softmax runs online in fp32 (base 2). The decode path reads only device tensors and shapes, so it
can be captured in a CUDA graph; the extend path plans its grid from the host query lengths.

It is not a general flash-attention: no sliding window, no sinks, no alibi, head_dim a power of
two in [16, 256], page size a power of two >= 16, k/v rows contiguous in the last dimension.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ft.forward_context import ForwardBatch

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(k, v, k_cache, v_cache, slots, s_kt, s_kh, s_vt, s_vh, s_cb, s_cs, s_ch,
                     HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HP: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot < 0:
        return
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = h < HKV
    dst = (slot // PAGE) * s_cb + (slot % PAGE) * s_cs + h * s_ch + d
    kt = tl.load(k + t * s_kt + h * s_kh + d, mask=mask)
    vt = tl.load(v + t * s_vt + h * s_vh + d, mask=mask)
    tl.store(k_cache + dst, kt.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, vt.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse, qk_scale,
                   s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
                   REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    # one program = one sequence x one kv head (all REP query heads packed as rows) x one KV split
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, D)
    heads = hk * REP + r
    rmask = r < REP
    qb = tl.load(q + b * s_qt + heads[:, None] * s_qh + d[None, :], mask=rmask[:, None], other=0.0)
    m_i = tl.full([REP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([REP_P], tl.float32)
    acc = tl.zeros([REP_P, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        blk = tl.load(block_tables + b * s_bt + n // PAGE, mask=nmask, other=0).to(tl.int64)
        off = blk * s_cb + (n % PAGE) * s_cs + hk * s_ch
        kb = tl.load(k_cache + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)  # [N, D]
        vb = tl.load(v_cache + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(qb, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(qb, tl.trans(kb))
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))  # [REP_P, N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLITS == 1:
        tl.store(out + b * s_ot + heads[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty),
                 mask=rmask[:, None])
    else:
        row = (b * (tl.num_programs(1) * REP) + heads) * SPLITS + split  # part_o [B, Hq, SPLITS, D]
        tl.store(part_o + row[:, None] * D + d[None, :], o, mask=rmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse + row, lse, mask=rmask)


@triton.jit
def _combine_kernel(part_o, part_lse, out, s_ot, s_oh, HQ: tl.constexpr, D: tl.constexpr,
                    SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    base = (b * HQ + h) * SPLITS
    lse = tl.load(part_lse + base + sp)  # [SPLITS]
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits carry -inf: weight 0
    o = tl.load(part_o + (base + sp)[:, None] * D + d[None, :])  # [SPLITS, D]
    total = tl.sum(w, 0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # padded rows (seq_len 0) -> 0
    tl.store(out + b * s_ot + h * s_oh + d, o.to(out.dtype.element_ty))


@triton.jit
def _extend_kernel(q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, out, qk_scale,
                   s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
                   REP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # one program = BLOCK_M queries of one sequence x one query head
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens + b).to(tl.int64)
    q_len = tl.load(cu_seqlens + b + 1).to(tl.int64) - q_start
    if mb * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens + b)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    d = tl.arange(0, D)
    rows = q_start + m
    qb = tl.load(q + rows[:, None] * s_qt + h * s_qh + d[None, :], mask=mmask[:, None], other=0.0)
    qpos = ctx + m  # absolute positions of the queries
    kv_end = tl.minimum(ctx + q_len, ctx + (mb + 1) * BLOCK_M)
    hk = h // REP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < kv_end
        blk = tl.load(block_tables + b * s_bt + n // PAGE, mask=nmask, other=0).to(tl.int64)
        off = blk * s_cb + (n % PAGE) * s_cs + hk * s_ch
        kb = tl.load(k_cache + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        vb = tl.load(v_cache + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(qb, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(qb, tl.trans(kb))
        visible = nmask[None, :] & (n[None, :] <= qpos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    o = acc / l_i[:, None]  # every query sees key 0, so l_i > 0
    tl.store(out + rows[:, None] * s_ot + h * s_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=mmask[:, None])


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
    assert q.is_cuda and kv_cache.is_cuda, "TritonAttention needs CUDA tensors"
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q/k/v must be [T, H, d], got {q.shape}"
    two, _, page, hkv, d = kv_cache.shape
    assert two == 2, f"kv_cache must be [2, blocks, block_size, Hkv, d], got {tuple(kv_cache.shape)}"
    assert k.shape == v.shape == (q.shape[0], hkv, d), f"k/v {tuple(k.shape)} do not fit cache {hkv}x{d}"
    assert q.shape[-1] == d and q.shape[1] % hkv == 0, f"q heads {q.shape[1]} not a multiple of {hkv}"
    assert d in (16, 32, 64, 128, 256), f"head_dim {d} must be a power of two in [16, 256]"
    assert page >= 16 and page & (page - 1) == 0, f"block_size {page} must be a power of two >= 16"
    assert kv_cache.stride(-1) == 1 and kv_cache[0].is_contiguous(), "kv_cache must be contiguous"
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}"


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k/v [T, Hkv, d] at flat slots [T] of kv_cache [2, blocks, page, Hkv, d]; -1 skips."""
    if k.shape[0] == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    kc, vc = kv_cache[0], kv_cache[1]
    hkv, d = kc.shape[-2:]
    _store_kv_kernel[(k.shape[0],)](
        k, v, kc, vc, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        HKV=hkv, D=d, PAGE=kc.shape[1], HP=triton.next_power_of_2(hkv),
    )


def _num_splits(batch_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Enough KV splits to fill the SMs twice, never more than there are KV tiles (shape-only)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.next_power_of_2(max(1, math.ceil(2 * sms / batch_heads)))
    tiles = triton.next_power_of_2(max(1, math.ceil(max_tokens / block_n)))
    return max(1, min(want, tiles, 32))


def paged_decode(q, kv_cache, block_tables, seq_lens, scale: float, num_splits: int | None = None):
    """One query per sequence. q [B, Hq, d]; seq_lens [B] includes the new token -> [B, Hq, d]."""
    bsz, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    page, hkv = kc.shape[1], kc.shape[2]
    rep = hq // hkv
    block_n = 64 if d <= 128 else 32
    if num_splits is None:
        num_splits = _num_splits(bsz * hkv, block_tables.shape[1] * page, block_n, q.device)
    assert num_splits & (num_splits - 1) == 0, f"num_splits {num_splits} must be a power of two"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    part_o = part_lse = out  # unused when num_splits == 1
    if num_splits > 1:
        part_o = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(bsz, hkv, num_splits)](
        q, kc, vc, block_tables, seq_lens, out, part_o, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=d, PAGE=page, BLOCK_N=block_n,
        SPLITS=num_splits, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _combine_kernel[(bsz, hq)](part_o, part_lse, out, out.stride(0), out.stride(1),
                                   HQ=hq, D=d, SPLITS=num_splits, num_warps=4)
    return out


def paged_extend(q, kv_cache, block_tables, cu_seqlens, context_lens, max_query_len: int, scale: float):
    """Queries [T, Hq, d] with prior context; sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]."""
    t, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    page, hkv = kc.shape[1], kc.shape[2]
    fp32 = q.dtype == torch.float32
    block_m = 64 if d <= 128 and not fp32 else 32
    block_n = 64 if d <= 64 else 32
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(max_query_len, block_m), cu_seqlens.shape[0] - 1, hq)
    _extend_kernel[grid](
        q, kc, vc, block_tables, cu_seqlens, context_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        REP=hq // hkv, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=fp32,
        num_warps=8 if d >= 128 else 4, num_stages=2,
    )
    return out


class TritonAttention:
    name = "triton"

    def forward(self, q, k, v, kv_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        _check(q, k, v, kv_cache)
        q = q if q.stride(-1) == 1 else q.contiguous()
        store_kv(kv_cache, k, v, batch.slot_mapping)
        if q.shape[0] == batch.seq_lens.shape[0]:  # one token per sequence: decode, shapes only
            return paged_decode(q, kv_cache, batch.block_tables, batch.seq_lens, scale)
        return paged_extend(q, kv_cache, batch.block_tables, batch.cu_seqlens, batch.context_lens,
                            max(batch.query_lens_cpu), scale)
