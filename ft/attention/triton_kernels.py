"""The Triton kernels of paged attention; ``triton_paged`` holds their wrappers and the backend.

Keys are gathered through the block table one BLOCK_N tile at a time (a tile may span pages), and
softmax runs online in fp32 and base 2 (``qk_scale`` already carries log2(e)). ``PREC`` is the
``tl.dot`` input precision: "ieee" for fp32 inputs, "tf32" (the default, unused for 16-bit) else.
With ``GATE`` the decode kernels end in the output gate, out · sigmoid(gate) for the [B, Hq, d]
gate view of the projection, rounded as ``ft.layers.triton_rope.sigmoid_gate`` would round it
after them: in the combine, or in the decode kernel when there is one split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.layers.pdl import wait_for_previous
from ft.layers.triton_rope import gate_rounded


@triton.jit
def store_kv_kernel(
    k, v, k_cache, v_cache, slots, s_kt, s_kh, s_vt, s_vh, s_cb, s_cs, s_ch,
    HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)  # t · s_vt passes 2^31 in chunks of 233k tokens (9,216-wide rows)
    slot = tl.load(slots + t)
    if slot < 0:  # padding row
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
def _attend_tile(
    qb, k_cache, v_cache, table, hk, n, nmask, visible, m_i, l_i, acc, qk_scale, s_cb, s_cs, s_ch,
    D: tl.constexpr, PAGE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One online-softmax step: q rows qb [M, D] against cached keys n [N] of kv head hk."""
    d = tl.arange(0, D)
    blk = tl.load(table + n // PAGE, mask=nmask, other=0).to(tl.int64)
    off = blk * s_cb + (n % PAGE) * s_cs + hk * s_ch  # [N] element offsets of the cached rows
    kb = tl.load(k_cache + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)  # [N, D]
    vb = tl.load(v_cache + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
    s = tl.dot(qb, tl.trans(kb), input_precision=PREC)  # [M, N]
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def decode_kernel(
    q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse, gate, qk_scale,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt, s_gt, s_gh,
    REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr, GATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    # one program = one sequence x one kv head (its REP query heads packed as rows) x one KV split
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    per_split = _per_split(seq_len, SPLITS, BLOCK_N)
    start = split * per_split
    if SPLITS > 1 and start >= seq_len:  # an empty split: the combine reads live splits only
        return
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
        m_i, l_i, acc = _attend_tile(
            qb, k_cache, v_cache, block_tables + b * s_bt, hk, n, nmask, nmask[None, :], m_i, l_i, acc,
            qk_scale, s_cb, s_cs, s_ch, D, PAGE, PREC,
        )  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a padded row with seq_len 0
    o = acc / l_safe[:, None]
    if SPLITS == 1:
        o = o.to(out.dtype.element_ty)
        if GATE:
            g = tl.load(gate + b * s_gt + heads[:, None] * s_gh + d[None, :], mask=rmask[:, None], other=0.0)
            o = gate_rounded(o, g)
        dst = out + b * s_ot + heads[:, None] * s_oh + d[None, :]
        tl.store(dst, o, mask=rmask[:, None])
    else:
        row = (b * (tl.num_programs(1) * REP) + heads) * SPLITS + split  # into [B, Hq, SPLITS]
        tl.store(part_o + row[:, None] * D + d[None, :], o, mask=rmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse + row, lse, mask=rmask)


@triton.jit
def _per_split(seq_len, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    # the keys each of a sequence's SPLITS splits takes, whole tiles: splits 0 .. live - 1 hold keys
    return tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def combine_kernel(
    part_o, part_lse, seq_lens, out, gate, s_ot, s_oh, s_gt, s_gh,
    HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, GATE: tl.constexpr,
    CHUNK: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # the live splits' outputs weighted by exp2(lse - the largest lse), CHUNK splits at a time: with
    # SPLITS <= CHUNK one load of them all, else a pass for the largest lse and one for the sums
    wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    per_split = _per_split(seq_len, SPLITS, BLOCK_N)
    live = tl.where(per_split > 0, tl.cdiv(seq_len, tl.maximum(per_split, 1)), 0)
    sp = tl.arange(0, CHUNK)
    d = tl.arange(0, D)
    base = (b * HQ + h) * SPLITS
    if SPLITS <= CHUNK:
        lse = tl.load(part_lse + base + sp, mask=sp < live, other=float("-inf"))  # [CHUNK]
        top = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # past the live splits: weight 0
        o = tl.load(part_o + (base + sp)[:, None] * D + d[None, :], mask=(sp < live)[:, None], other=0.0)
        total = tl.sum(w, 0)
        o = tl.sum(o * w[:, None], 0)
    else:
        top = tl.full([CHUNK], float("-inf"), tl.float32)
        for c in range(0, live, CHUNK):
            top = tl.maximum(top, tl.load(part_lse + base + c + sp, mask=c + sp < live, other=float("-inf")))
        top = tl.max(top, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = 0.0
        o = tl.zeros([D], tl.float32)
        for c in range(0, live, CHUNK):
            m = c + sp < live
            w = tl.exp2(tl.load(part_lse + base + c + sp, mask=m, other=float("-inf")) - top)
            part = tl.load(part_o + (base + c + sp)[:, None] * D + d[None, :], mask=m[:, None], other=0.0)
            total += tl.sum(w, 0)
            o += tl.sum(part * w[:, None], 0)
    o = o / tl.where(total > 0, total, 1.0)  # padded rows (seq_len 0) -> 0
    o = o.to(out.dtype.element_ty)
    if GATE:
        o = gate_rounded(o, tl.load(gate + b * s_gt + h * s_gh + d))
    tl.store(out + b * s_ot + h * s_oh + d, o)


@triton.jit
def extend_kernel(
    q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, out, qk_scale,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
    REP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
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
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < kv_end
        visible = nmask[None, :] & (n[None, :] <= qpos[:, None])  # causal
        m_i, l_i, acc = _attend_tile(
            qb, k_cache, v_cache, block_tables + b * s_bt, h // REP, n, nmask, visible, m_i, l_i, acc,
            qk_scale, s_cb, s_cs, s_ch, D, PAGE, PREC,
        )  # fmt: skip
    o = acc / l_i[:, None]  # every query sees key 0, so l_i > 0
    dst = out + rows[:, None] * s_ot + h * s_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=mmask[:, None])
