"""The MoE block's Triton kernels, the attention's q/k norm + rope, the split-K dense GEMV and the
router GEMV with its top-k epilogue, run by Triton's interpreter on CPU tensors.

Skipped without triton (CI has it); ``tests/gpu/test_moe_fusions.py`` checks the
compiled kernels on a GPU. The interpreter is chosen when a kernel is decorated, so each check
runs in a process of its own with ``TRITON_INTERPRET=1`` (``run_check``). It truncates fp32 ->
bf16 where the GPU rounds to nearest, so exact rounding is checked in fp16 and fp32 only.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER


def tie_free_logits(t: int, e: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, E] distinct values k/64, |k| <= 256 (exact in fp16 and bf16): no top-k ties."""
    return ((torch.rand(t, 512).argsort(-1)[:, :e].float() - 256) / 64).to(dtype)


def check_router() -> None:
    from ft.moe.kernels.triton_router import launch_softmax_topk
    from ft.moe.router import route

    for (e, k), t, dtype, renormalize in (
        ((512, 10), 1, torch.float16, True),
        ((512, 10), 7, torch.float32, False),
        ((128, 8), 7, torch.float16, False),
        ((128, 8), 3, torch.float32, True),
        ((60, 4), 5, torch.float32, True),  # E padded to 64
    ):
        logits = tie_free_logits(t, e, dtype)
        weights, ids = launch_softmax_topk(logits, k, renormalize)
        ref_w, ref_ids = route(logits, k, renormalize)
        assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids), (e, k, t, dtype)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
    ties = torch.zeros(1, 16)
    ties[0, [3, 9]] = 1.0
    assert launch_softmax_topk(ties, 4, False)[1].tolist() == [[3, 9, 0, 1]]


def check_router_keys32() -> None:
    """``triton_router.KEYS32`` (bf16 logits picked with int32 keys): the same ids and the same
    weights, bit for bit, as the int64 keys, on logits with ties (the lower expert first), negative
    values, both zeros and an E padded with -inf; the fused router's epilogue likewise, on bf16
    activations; and ``route``'s ids on tie-free logits."""
    from ft.layers import triton_gemv
    from ft.moe.kernels import triton_router
    from ft.moe.kernels.triton_router_gemv import launch_router_topk
    from ft.moe.router import route

    shipped = triton_router.KEYS32
    gen = torch.Generator().manual_seed(5)
    for (e, k), t, renormalize in (((512, 10), 3, True), ((60, 4), 2, False), ((128, 8), 2, True)):
        tied = torch.randint(-12, 12, (t, e), generator=gen).float() / 4
        tied[1::2] -= 8  # every pick negative
        tied[0] = -tied[0].abs()  # row 0 at most 0: the zeros below are among its picks
        tied[0, :3] = torch.tensor([0.0, -0.0, 0.0])
        tied = tied.to(torch.bfloat16)
        for logits in (tied, tie_free_logits(t, e, torch.bfloat16)):
            outs = []
            for on in (False, True):
                triton_router.KEYS32 = on
                outs.append(triton_router.launch_softmax_topk(logits, k, renormalize))
            assert torch.equal(outs[0][1], outs[1][1]), (e, k, t, "ids")
            assert torch.equal(outs[0][0], outs[1][0]), (e, k, t, "weights")
        ref_w, ref_ids = route(logits, k, renormalize)  # the tie-free logits
        assert torch.equal(outs[1][1], ref_ids), (e, k, t)
    for t, h in ((1, 512), (4, 300)):
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        w = (torch.randn(513, h, generator=gen) * h**-0.5).to(torch.bfloat16)
        outs = []
        for on in (False, True):
            triton_router.KEYS32 = on
            outs.append(launch_router_topk(x, w, 10, True, True))
        for a, b, what in zip(outs[0], outs[1], ("weights", "ids", "gate logit")):
            assert torch.equal(a, b), (t, h, what)
        assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"
    triton_router.KEYS32 = shipped


def check_sums() -> None:
    from ft.moe.kernels.triton_combine import launch_sum_topk

    torch.manual_seed(0)

    cases = ((1, 10, 2048, torch.float16), (7, 8, 1000, torch.float32), (3, 1, 64, torch.float16))
    for t, k, h, dtype in cases:
        y = torch.randn(t, k, h).to(dtype)
        gate, shared = torch.randn(t, 1).to(dtype), torch.randn(t, h).to(dtype)
        got, got_shared = launch_sum_topk(y), launch_sum_topk(y, gate, shared)
        exact = y.double().sum(1)
        term = torch.sigmoid(gate.double()) * shared.double()
        assert got.dtype == got_shared.dtype == dtype
        for out, ref in ((got, exact), (got_shared, exact + term)):
            if dtype == torch.float16:  # fp32 accumulation, one rounding: off by one ulp, rarely
                want = ref.to(dtype)
                ulp = (torch.nextafter(want.abs(), torch.tensor(math.inf, dtype=dtype)) - want.abs()).double()
                off = (out.double() - want.double()).abs()
                assert (off <= ulp).all() and (off > 0).float().mean() < 1e-2, off.max()
            else:
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-6)


def check_grouped_gemm() -> None:
    """The prefill-sized fused MoE for 16-bit banks (``fused_moe_triton``: the pairs sorted by
    expert and padded, two grouped GEMMs, the top-k sum) within fp16 / bf16 error of the torch
    reference: several row blocks of pairs, the down product over one and two column blocks, K
    tails. bf16 with the interpreter's dots made exact (``exact_bf16_dots``: it multiplies bf16
    operands' bit patterns, triton issue 11584)."""
    from ft.moe.kernels.torch_ref import fused_moe_ref
    from ft.moe.kernels.triton_moe import fused_moe_triton
    from tests.interpreter import exact_bf16_dots

    exact_bf16_dots()
    gen = torch.Generator().manual_seed(5)
    for t, e, h, inter, k in ((20, 8, 64, 48, 3), (70, 16, 144, 80, 4)):
        x = torch.randn(t, h, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen)
        w13 = torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5
        w2 = torch.randn(e, h, inter, generator=gen) * inter**-0.5
        for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)):
            got = fused_moe_triton(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids).float()
            want = fused_moe_ref(x, w13.to(dtype).float(), w2.to(dtype).float(), weights, ids)
            err = ((got - want).norm() / want.norm()).item()
            if not err < tol:  # raised, not asserted: the check runs under -O
                raise AssertionError(f"{dtype}, T={t}: relative error {err:.3g} against the torch reference")


def check_grouped_gemm_into() -> None:
    """``Into``: the grouped GEMMs reading a call's tokens through a map of x's rows and writing its
    terms into rows of another tensor give, bit for bit, the terms of the call on the gathered
    tokens at those rows, and leave every other row alone."""
    from ft.moe.kernels.into import Into
    from ft.moe.kernels.triton_moe import fused_moe_triton

    gen = torch.Generator().manual_seed(7)
    t, e, h, inter, p = 40, 8, 64, 48, 23
    x = torch.randn(t, h, generator=gen).half()
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).half()
    w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).half()
    tokens = torch.randint(0, t, (p,), generator=gen)
    ids = torch.randint(0, e, (p, 1), generator=gen)
    weights = torch.rand(p, 1, generator=gen)
    rows = torch.randperm(3 * p, generator=gen)[:p]
    out = torch.full((3 * p, h), 7.0, dtype=torch.float16)
    want = out.clone()
    want[rows] = fused_moe_triton(x[tokens], w13, w2, weights, ids)
    got = fused_moe_triton(x, w13, w2, weights, ids, into=Into(tokens, out, rows))
    if got is not out or not torch.equal(out, want):  # raised, not asserted: the check runs under -O
        raise AssertionError(f"{(out != want).any(1).sum()} rows differ from the gathered call's")


def check_align_by_expert() -> None:
    """Pairs sorted by expert and padded (``align_by_expert``), in one program and in the three
    launches, for expert counts that are not powers of two (a pre-staged buffer's rows): every pair
    once, each under its own expert's blocks."""
    from ft.moe.kernels.align import align_by_expert

    gen = torch.Generator().manual_seed(9)
    for e, block_m, small in ((100, 16, 1024), (100, 32, 0), (13, 16, 0), (13, 16, 1024)):
        ids = torch.rand(40, e, generator=gen).topk(4, dim=-1).indices
        sorted_ids, block_expert, num_padded = align_by_expert(ids, e, block_m, small=small)
        used = sorted_ids[: int(num_padded)]
        keep = used < ids.numel()
        if not torch.equal(used[keep].sort().values, torch.arange(ids.numel())):
            raise AssertionError(f"E={e}, small={small}: a pair missing or repeated")
        experts = block_expert[: int(num_padded) // block_m].repeat_interleave(block_m)
        if not torch.equal(ids.reshape(-1)[used[keep]], experts[keep]):
            raise AssertionError(f"E={e}, small={small}: a pair sorted under the wrong expert")


def check_silu_and_mul() -> None:
    from ft.moe.kernels.triton_combine import launch_silu_and_mul

    cases = (((1, 1024), torch.float16), ((7, 1536), torch.float32), ((2, 3, 2000), torch.float16))
    for shape, dtype in cases:
        x = (torch.randn(shape) * 3).to(dtype)
        got = launch_silu_and_mul(x)
        gate, up = x.float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
        assert got.shape == ref.shape and got.dtype == dtype
        rtol = 2**-10 if dtype == torch.float16 else 1e-6  # an fp16 ulp: one rounding of fp32
        torch.testing.assert_close(got.float(), ref, atol=1e-6, rtol=rtol)


def pairs_one_at_a_time(gemv, x, w13, w2, weights, ids) -> torch.Tensor:
    """What the offload backend's streaming does: each (token, slot) pair alone (k = 1), its
    term summed into an fp32 row in slot order, rounded once."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(ids.shape[1]):
        out += gemv(x, w13, w2, weights[:, j : j + 1], ids[:, j : j + 1]).float()
    return out.to(x.dtype)


def check_moe_gemv_pairs() -> None:
    """The MoE GEMV rounds each pair's weighted term before summing a token's k terms, so a batch
    computed a pair at a time and summed in the same order gives the same bits as one call;
    a term-rounding bug (one rounding of the whole sum) fails this within a few rows."""
    from ft.moe.kernels.triton_moe_gemv import launch_moe_gemv
    from tests.nvfp4.test_w4a16_gpu import random_bank

    gen = torch.Generator().manual_seed(0)
    e, inter, h, t = 8, 48, 64, 3
    for k, fmt in ((2, "fp16"), (4, "fp16"), (3, "nvfp4")):
        if fmt == "nvfp4":
            w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        else:
            w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).half()
            w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).half()
            x = torch.randn(t, h, generator=gen).half()
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen) / k
        whole = launch_moe_gemv(x, w13, w2, weights, ids).float()
        pairs = pairs_one_at_a_time(launch_moe_gemv, x, w13, w2, weights, ids).float()
        if fmt == "nvfp4":  # bf16: the interpreter truncates the final rounding, torch rounds
            torch.testing.assert_close(whole, pairs, atol=0, rtol=2**-7)
        else:
            assert torch.equal(whole, pairs), k


def check_qk_norm_rope() -> None:
    """The q/k norm + rope kernel, a head per program (decode sizes) and eight (prefill), equals
    the torch path: norm, round, rotate; partial rotary, zero-centred weights, a head count
    that leaves the last group of eight part empty. fp32 to rounding; the two layouts alike."""
    from ft.layers import triton_rope
    from ft.layers.norm import RMSNorm
    from ft.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    triton_rope.PREFILL_TOKENS = 16  # eight heads a program from 16 tokens (shipped: 64; the interpreter)
    for t, (hq, hkv, d, rot, zc) in [
        (3, (5, 2, 64, 32, True)),
        (22, (5, 2, 64, 32, True)),
        (16, (6, 1, 32, 32, False)),
    ]:
        rope = RotaryEmbedding(d, rot, 1e6)
        norms = [RMSNorm(d, 1e-6, zc) for _ in range(2)]
        for n in norms:
            n.weight.data = torch.randn(d, generator=gen) * 0.2 + (0.0 if zc else 1.0)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2
        q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        positions = torch.randint(0, 100_000, (t,), generator=gen)
        args = (positions, q, k, norms[0].weight, norms[1].weight, rope.inv_freq, 1e-6, zc)
        got = triton_rope.qk_norm_rope(*args)
        want = rope(positions, norms[0](q), norms[1](k))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        triton_rope.PREFILL_TOKENS = 10**9  # the same call a head per program
        for g, o in zip(got, triton_rope.qk_norm_rope(*args)):
            assert torch.equal(g, o), t
        triton_rope.PREFILL_TOKENS = 16


def check_moe_gemv_shared_pair() -> None:
    """The shared expert as one more pair of each token (``launch_moe_gemv(..., shared=...)``) is
    bit for bit the same call with the shared expert appended to the bank and routed to every
    token with weight sigmoid(logit) (logits whose sigmoid is exact: 0, 30, -100), in fp16, and
    within fp16 error of the unfused block (routed sum + sigmoid · shared expert's MLP); beside
    an NVFP4 bank, the routed pairs and the shared term each alone, summed in fp32."""
    from ft.moe.kernels.triton_moe_gemv import launch_moe_gemv

    gen = torch.Generator().manual_seed(2)
    e, inter, h, t, k = 8, 48, 64, 3, 3
    w13 = (torch.randn(e + 1, 2 * inter, h, generator=gen) * h**-0.5).half()
    w2 = (torch.randn(e + 1, h, inter, generator=gen) * inter**-0.5).half()
    x = torch.randn(t, h, generator=gen).half()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) / k
    logit = torch.tensor([[0.0], [30.0], [-100.0]]).half()
    fused = launch_moe_gemv(x, w13[:e], w2[:e], weights, ids, shared=(w13[e], w2[e], logit))
    gate = 1 / (1 + torch.exp(-logit.float()))  # 0.5, 1, 0 exactly
    as_routed = launch_moe_gemv(
        x, w13, w2, torch.cat([weights, gate], 1), torch.cat([ids, torch.full((t, 1), e)], 1)
    )
    assert torch.equal(fused, as_routed)
    # a streamed batch: each routed pair alone, then the shared term alone (k = 0, as the offload
    # backend's ``shared_pair_alone``), summed in fp32 in that order and rounded once
    none = torch.zeros(t, 0, dtype=torch.long)
    streamed = torch.zeros(t, h)
    for j in range(k):
        streamed += launch_moe_gemv(x, w13[:e], w2[:e], weights[:, j : j + 1], ids[:, j : j + 1]).float()
    streamed += launch_moe_gemv(x, w13[e:], w2[e:], none.float(), none, (w13[e], w2[e], logit)).float()
    assert torch.equal(streamed.half(), fused)
    routed = launch_moe_gemv(x, w13[:e], w2[:e], weights, ids).float()
    hid = x.float() @ w13[e].float().T
    mlp = (F.silu(hid[:, :inter]) * hid[:, inter:]).half().float() @ w2[e].float().T
    torch.testing.assert_close(fused.float(), routed + gate * mlp, atol=2e-3, rtol=1e-2)
    # beside an NVFP4 bank (bf16 activations, so to the interpreter's bf16 truncation): the pairs
    # one at a time, then the shared term as a one-expert bf16 call, summed in fp32
    from ft.moe.kernels import triton_moe_gemv
    from tests.nvfp4.test_w4a16_gpu import random_bank

    q13, q2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
    xb, s13, s2, lb = x.bfloat16(), w13[e].bfloat16(), w2[e].bfloat16(), logit.bfloat16()
    alone = launch_moe_gemv(xb, s13[None], s2[None], gate, torch.zeros(t, 1, dtype=torch.long)).float()
    for j in range(k):
        alone += launch_moe_gemv(xb, q13, q2, weights[:, j : j + 1], ids[:, j : j + 1]).float()
    for steps in ((0, 0), (16, 16), (32, 16)):  # the shared rows' own steps (``NVFP4_SHARED_BK``), K tails
        triton_moe_gemv.NVFP4_SHARED_BK, triton_moe_gemv.NVFP4_SHARED_BK_DOWN = steps
        fused = launch_moe_gemv(xb, q13, q2, weights, ids, shared=(s13, s2, lb)).float()
        torch.testing.assert_close(fused, alone.bfloat16().float(), atol=0, rtol=2**-7)


def check_moe_gemv_int_dot() -> None:
    """``FP4_INT_DOT`` (gate/up's NVFP4 products as int16 inputs times int8 codes), its steps as
    the interpreter runs them (integer arithmetic, no PTX): the inputs' blocks as the torch rule
    makes them, bit for bit, with a block of zeros, one clamped and one spanning 2^40; an input at
    least 2^-7 of its block's largest held exactly, the rest to 2^-15 of it; the call within one
    bf16 step of the words with block sums, with a K tail."""
    from ft.moe.kernels import int_dot, triton_moe_gemv
    from tests.gpu.test_moe_gemv import quantize_blocks_ref
    from tests.nvfp4.test_w4a16_gpu import random_bank

    gen = torch.Generator().manual_seed(3)
    e, inter, t, k = 4, 16, 2, 2
    for h in (64, 48):
        w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        x[0, :16] = torch.tensor([2.0**-100, -(2.0**-120)] + [0.0] * 14)
        x[1, :16] = 0.0
        x[1, 16:32] = torch.logspace(-20, 20, 16, base=2)
        blocks = int_dot.quantize_blocks(x)
        for got, want in zip(blocks, quantize_blocks_ref(x)):
            assert torch.equal(got, want), h
        # an input at least 2^-7 of its block's largest is held exactly: x times 2^(14 - E) is an integer
        back = (blocks[0].float().view(t, -1, 16) * blocks[1][..., None] * 2**15).view(t, h)
        top = x.float().abs().view(t, -1, 16).amax(-1, keepdim=True).expand(t, h // 16, 16).reshape(t, h)
        held = x.float().abs() >= top * 2**-7
        assert torch.equal(back[held], x.float()[held]), h
        assert ((back - x.float()).abs() <= top.clamp(min=2.0**-96) * 2**-15).all(), h  # the rest to 2^-15
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=gen) / k
        outs = []
        for on in (False, True):
            triton_moe_gemv.FP4_INT_DOT = on
            outs.append(triton_moe_gemv.launch_moe_gemv(x, w13, w2, weights, ids).float())
        assert ((outs[0] - outs[1]).abs() <= outs[0].abs().clamp(min=1e-3) * 2**-7).all(), h


def routing_and_shared_pair(gen, t: int, e: int, k: int, inter: int, h: int, dtype) -> tuple:
    """Random distinct experts and weights [T, k] and a shared pair (gate_up, down, logit) in dtype."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) / k
    shared = (
        (torch.randn(2 * inter, h, generator=gen) * h**-0.5).to(dtype),
        (torch.randn(h, inter, generator=gen) * inter**-0.5).to(dtype),
        torch.randn(t, 1, generator=gen).to(dtype),
    )
    return ids, weights, shared


def check_moe_gemv_host_rows() -> None:
    """Experts read from a host store inside the kernel (``launch_moe_gemv(..., host=...)``, ids
    e < 0 meaning host row -e - 1) give the bits of the same call on a bank holding every expert:
    fp16 with and without the shared pair, and NVFP4 (codes, scales and per-row globals all read
    from the row's side), whichever experts sit in slots. Slots no expert holds and the host rows
    of the experts in slots are NaN, so reading the wrong side fails. NVFP4 through the words'
    products: the integer ones pick their rows by the same ``_expert`` and take the interpreter
    several times longer (their GPU test reads host rows too: tests/offload/test_offload_gpu.py)."""
    from ft.moe.kernels import triton_moe_gemv
    from ft.moe.kernels.triton_moe_gemv import launch_moe_gemv
    from ft.quant.nvfp4 import NVFP4Tensor
    from tests.nvfp4.test_w4a16_gpu import random_bank

    triton_moe_gemv.FP4_INT_DOT = False

    gen = torch.Generator().manual_seed(3)
    e, inter, h, t, k, s = 8, 48, 64, 3, 3, 4
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5).half()
    w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).half()
    x = torch.randn(t, h, generator=gen).half()
    ids, weights, shared = routing_and_shared_pair(gen, t, e, k, inter, h, torch.half)
    q13, q2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
    for used in (0, 2, s):  # experts in slots: none, some, as many as there are slots
        in_slot = torch.randperm(e, generator=gen)[:used]
        route = -(torch.arange(e) + 1)  # every expert on the host ...
        route[in_slot] = torch.randperm(s + 1, generator=gen)[:used]  # ... but these, in their slots
        holder = torch.zeros(s + 1, dtype=torch.long)
        holder[route[in_slot]] = in_slot
        empty = torch.ones(s + 1, dtype=torch.bool)
        empty[route[in_slot]] = False

        def split(w, holder=holder, empty=empty, in_slot=in_slot):
            # (slot rows, host rows), each poisoned where the kernel must not read
            if isinstance(w, NVFP4Tensor):  # NaN globals poison a row of either side
                slot_g, host_g = w.weight_scale_2[holder].clone(), w.weight_scale_2.clone()
                slot_g[empty], host_g[in_slot] = float("nan"), float("nan")
                slot = NVFP4Tensor(w.weight[holder], w.weight_scale[holder], slot_g)
                return slot, NVFP4Tensor(w.weight, w.weight_scale, host_g)
            slot, host = w[holder].clone(), w.clone()
            slot[empty], host[in_slot] = float("nan"), float("nan")
            return slot, host

        (s13, h13), (s2, h2) = split(w13), split(w2)
        default_tiles = triton_moe_gemv.HOST_TILES
        for sh in (None, shared):
            want = launch_moe_gemv(x, w13, w2, weights, ids, sh)
            for host_tiles in (False, True):  # the host-read launch at tiles of its own, same bits
                triton_moe_gemv.HOST_TILES = host_tiles
                got = launch_moe_gemv(x, s13, s2, weights, route[ids], sh, host=(h13, h2))
                assert torch.equal(got, want), (used, sh is None, host_tiles)
            triton_moe_gemv.HOST_TILES = default_tiles
        (s13, h13), (s2, h2) = split(q13), split(q2)
        want = launch_moe_gemv(x.bfloat16(), q13, q2, weights, ids)
        for stages in (None, (3, 2)):  # the host-read launches' own loop stages: the same bits
            triton_moe_gemv.NVFP4_HOST_STAGES = stages
            got = launch_moe_gemv(x.bfloat16(), s13, s2, weights, route[ids], host=(h13, h2))
            assert torch.equal(got, want), (used, stages)
        triton_moe_gemv.NVFP4_HOST_STAGES = None


@contextlib.contextmanager
def programs_shuffled(seed: int):
    """Each launch's programs in a random order: the interpreter runs them one at a time in grid
    order, so without this the split-K kernels' last ticket always falls to the last split."""
    from triton.runtime import interpreter

    builder, gen, order = interpreter.interpreter_builder, torch.Generator().manual_seed(seed), []
    real = builder.set_grid_idx

    def set_grid_idx(x: int, y: int, z: int) -> None:
        _, gy, gz = builder.grid_dim
        i = (x * gy + y) * gz + z
        if i == 0:  # a new launch
            order[:] = torch.randperm(math.prod(builder.grid_dim), generator=gen).tolist()
        j = order[i]
        real(j // (gy * gz), j // gz % gy, j % gz)

    builder.set_grid_idx = set_grid_idx
    try:
        yield
    finally:
        del builder.set_grid_idx  # the class's method again


def check_split_k_gemv() -> None:
    """The split-K GEMV (``launch_gemv(x, w, splits)``): on integer operands, whose fp32 sums are
    exact in any order, it equals the product rounded once to fp16, bit for bit; on random ones it
    is within an fp16 ulp of it, the same bits on a second call with its programs run in a
    random order (the partials are summed in split order, not finishing order), and it leaves
    every ticket counter at zero. M = 1..4, 1..8 splits, N and K off the block sizes."""
    from ft.layers import triton_gemv

    gen = torch.Generator().manual_seed(3)
    cases = [
        (40, 64, 1, 1),
        (70, 300, 3, 3),
        (100, 1000, 2, 5),
        (33, 700, 4, 7),
        (1030, 512, 1, 2),
        (16, 2000, 4, 8),
        (513, 2048, 4, 8),
        (24, 4104, 2, 6),
        (70, 300, 1, 4),
    ]  # (N, K, M, splits)
    planned = set()
    for n, k, m, splits in cases:
        plan = triton_gemv.plan(n, k, splits)
        planned.add(plan.splits)
        xi = torch.randint(-3, 4, (m, k), generator=gen).half()
        wi = torch.randint(-3, 4, (n, k), generator=gen).half()
        exact = (xi.float() @ wi.float().T).half()  # |sums| < 2^24: exact in fp32, rounded once
        assert torch.equal(triton_gemv.launch_gemv(xi, wi, splits), exact), (n, k, m, splits)
        x = torch.randn(m, k, generator=gen).half()
        w = (torch.randn(n, k, generator=gen) * k**-0.5).half()
        got = triton_gemv.launch_gemv(x, w, splits)
        ref = x.double() @ w.double().T
        assert got.shape == (m, n) and got.dtype == torch.float16
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=2**-10)  # an fp16 ulp
        with programs_shuffled(n + k):  # a second call (a counter left non-zero fails it), in another order
            assert torch.equal(triton_gemv.launch_gemv(x, w, splits), got), "order changed the bits"
        assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"
    assert planned == set(range(1, 9)), planned
    cpu = torch.device("cpu")  # taken for 132 SMs: about two programs per SM
    shapes = {(2048, 4096): 2, (513, 2048): 8, (1024, 2048): 4, (12352, 2048): 1, (9216, 2048): 1}
    assert {s: triton_gemv.balanced_splits(*s, cpu) for s in shapes} == shapes
    triton_gemv.SPLIT_K = False
    assert triton_gemv.splits_for(513, 2048, cpu) == 1, "SPLIT_K off splits nothing"


def exact_router_operands(t: int, e: int, h: int, shared_gate: bool, seed: int, dtype=torch.float16):
    """x [T, H], w [E (+ 1), H] (exact in fp16 and bf16) whose expert logits are the tie-free k/64
    of ``tie_free_logits`` in any order of summation, and those logits [T, E]: token t's are the
    fractions k/64 mod 1 from input column t plus the whole parts from column H/2 + t, two K splits."""
    torch.manual_seed(seed)
    logits = tie_free_logits(t, e, torch.float32)  # [T, E]
    whole = torch.floor(logits)
    x, w = torch.zeros(t, h), torch.zeros(e + shared_gate, h)
    rows = torch.arange(t)
    x[rows, rows] = x[rows, h // 2 + rows] = 1.0
    w[:e, :t], w[:e, h // 2 : h // 2 + t] = (logits - whole).T, whole.T
    if shared_gate:
        w[e] = torch.randn(h) * h**-0.5
    return x.to(dtype), w.to(dtype), logits


def check_fused_router() -> None:
    """The router GEMV with its top-k softmax epilogue (``launch_router_topk``) equals
    ``launch_gemv`` with the same splits then ``launch_softmax_topk``: the same ids, the weights
    to 1e-6, the gate logit (the last weight row) the same bits; on exact tie-free logits also
    ``route``'s ids. Qwen3-Next's 512 experts + gate, top-10, and 128 experts, top-8, no gate;
    1..4 tokens, programs in a random order, the ticket counters zero after."""
    from ft.layers import triton_gemv
    from ft.moe.kernels.triton_router import launch_softmax_topk
    from ft.moe.kernels.triton_router_gemv import launch_router_topk
    from ft.moe.router import route

    gen = torch.Generator().manual_seed(4)
    for (e, k, gate), t, h, renormalize in (
        ((512, 10, True), 1, 2048, True),
        ((512, 10, True), 2, 512, False),
        ((512, 10, True), 3, 512, True),
        ((128, 8, False), 2, 300, True),
        ((128, 8, False), 4, 1000, False),
    ):
        x = torch.randn(t, h, generator=gen).half()
        w = (torch.randn(e + gate, h, generator=gen) * h**-0.5).half()
        splits = triton_gemv.balanced_splits(e + gate, h, x.device)
        with programs_shuffled(t * e):
            weights, ids, shared = launch_router_topk(x, w, k, renormalize, gate)
        logits = triton_gemv.launch_gemv(x, w, splits)
        ref_w, ref_ids = launch_softmax_topk(logits[:, :e], k, renormalize)
        assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids), (e, t)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
        if gate:
            assert shared.shape == (t, 1) and shared.dtype == x.dtype and torch.equal(shared, logits[:, e:])
        else:
            assert shared is None
        assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"
        x, w, exact = exact_router_operands(t, e, h, gate, seed=t + e)
        weights, ids, _ = launch_router_topk(x, w, k, renormalize, gate)
        ref_w, ref_ids = route(exact, k, renormalize)
        assert torch.equal(ids, ref_ids), (e, t)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
        if h % 16 == 0 and t <= 2:  # the int16 blocks for the MoE GEMV, over every split
            from ft.moe.kernels import int_dot
            from tests.gpu.test_moe_gemv import quantize_blocks_ref

            blocks = int_dot.empty_blocks(x)
            again = launch_router_topk(x, w, k, renormalize, gate, blocks=blocks)
            assert torch.equal(again[1], ids), (e, t)
            for got, want in zip(blocks, quantize_blocks_ref(x)):
                assert torch.equal(got, want), (e, t, h)


CHECKS = [
    "check_router",
    "check_router_keys32",
    "check_split_k_gemv",
    "check_fused_router",
    "check_sums",
    "check_silu_and_mul",
    "check_moe_gemv_pairs",
    "check_moe_gemv_shared_pair",
    "check_moe_gemv_host_rows",
    "check_moe_gemv_int_dot",
    "check_qk_norm_rope",
]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    run_check("tests.test_moe_fusions_interp", check)


def test_align_by_expert_under_the_interpreter():
    run_check("tests.test_moe_fusions_interp", "check_align_by_expert", optimize=True)


def test_the_alignment_kernels_compile_once_for_banks_of_up_to_their_floor(monkeypatch):
    """The expert count is a run-time argument of the alignment kernels, and the width compiled in
    is its power of two but at least ``ALIGN_MIN_EXPERTS``; no kernel of a grouped call specialises
    on its pair count. So a bank of another count (a pre-staged buffer's rows) or a call of another
    size compiles nothing anew; on an H200 (2026-12-03) the first runs of each pre-staging round
    took 0.7-1.9 s against ~0.5 s while they compiled."""
    triton = pytest.importorskip("triton")
    from ft.moe.kernels import align, triton_moe_kernel, triton_w4a16_kernel

    for fn in (align._align_kernel, align._runs_kernel, align._blocks_and_padding):
        constants = {p.name for p in fn.params if p.is_constexpr}
        assert "E" in fn.arg_names and "E" not in constants, fn.fn.__name__
    for fn in (align._align_kernel, align._runs_kernel):
        assert [p.name for p in fn.params if p.do_not_specialize] == ["N", "E"], fn.fn.__name__
    for fn in (align._count_kernel, align._place_kernel):
        assert [p.name for p in fn.params if p.do_not_specialize] == ["N"], fn.fn.__name__
    for fn in (triton_moe_kernel._grouped_gemm_kernel, triton_w4a16_kernel._w4a16_gemm_kernel):
        assert [p.name for p in fn.params if p.do_not_specialize] == ["num_pairs"], fn.fn.__name__
    # the offload backend's calls take slices of a batch's pairs (``pairs.device_runs``): where
    # they start is not a reason to compile again
    for fn in (align._align_kernel, align._count_kernel, align._place_kernel):
        assert [p.name for p in fn.params if p.do_not_specialize_on_alignment] == ["ids"], fn.fn.__name__
    for fn in (triton_moe_kernel._grouped_gemm_kernel, triton_w4a16_kernel._w4a16_gemm_kernel):
        unaligned = [p.name for p in fn.params if p.do_not_specialize_on_alignment]
        assert unaligned == ["topk_w", "a_map", "c_map"], fn.fn.__name__  # slices of a batch's, all three

    widths = []

    class Launch:  # records a launch's compiled-in expert width instead of running it
        def __getitem__(self, grid):
            return lambda *args, **kw: widths.append(kw.get("E_P"))

    for name in ("_align_kernel", "_count_kernel", "_runs_kernel", "_place_kernel"):
        monkeypatch.setattr(align, name, Launch())
    floor = align.ALIGN_MIN_EXPERTS
    for experts in (1, 9, 13, 100, floor, floor + 1, 4 * floor):
        for pairs in (1, 17, 4096):  # one program, then the three launches
            widths.clear()
            align.align_by_expert(torch.zeros(pairs, 1, dtype=torch.int64), experts, 16)
            want = floor if experts <= floor else triton.next_power_of_2(experts)
            assert [w for w in widths if w is not None] == [want], (experts, pairs, widths)


@pytest.mark.parametrize("check", ["check_grouped_gemm", "check_grouped_gemm_into"])
def test_grouped_gemm_under_the_interpreter(check):
    # under -O: the wrapper asserts CUDA tensors
    run_check("tests.test_moe_fusions_interp", check, optimize=True)
