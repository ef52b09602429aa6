"""GPU kernels against the torch references, on fresh random inputs.

Marked ``gpu`` (skipped without CUDA by tests/conftest.py); triton and fla are imported inside the
tests so that collecting this file on a CPU-only machine needs neither.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ft.forward_context import ForwardBatch

gpu = pytest.mark.gpu


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_batch(specs, block_size: int, device="cuda", state_slots=None, spare_blocks: int = 3):
    """specs [(context_len, query_len)] -> (ForwardBatch over shuffled blocks, num_blocks)."""
    need = [-(-(c + q) // block_size) for c, q in specs]
    num_blocks = sum(need) + spare_blocks
    free = list(range(num_blocks))
    random.shuffle(free)
    tables, slots, pos, cu = [], [], [], [0]
    for (c, q), n in zip(specs, need):
        blocks = [free.pop() for _ in range(n)]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        pos += range(c, c + q)
        cu.append(cu[-1] + q)
    width = max(need)
    tables = [b + [-1] * (width - len(b)) for b in tables]
    if state_slots is None:
        state_slots = list(range(len(specs)))

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    batch = ForwardBatch(
        positions=t(pos, torch.int64),
        cu_seqlens=t(cu, torch.int32),
        context_lens=t([c for c, _ in specs], torch.int32),
        seq_lens=t([c + q for c, q in specs], torch.int32),
        block_tables=t(tables, torch.int32),
        slot_mapping=t(slots, torch.int64),
        state_slots=t(state_slots, torch.int64),
        prev_token_ids=torch.full((len(specs), 0), -1, dtype=torch.int64, device=device),  # unused here
        block_size=block_size,
        query_lens_cpu=[q for _, q in specs],
        context_lens_cpu=[c for c, _ in specs],
    )
    return batch, num_blocks


# ---------------------------------------------------------------- attention


def run_attention(specs, hq, hkv, d, dtype, block_size=16, tol=2e-2):
    pytest.importorskip("triton")
    from ft.attention.torch_ref import TorchAttention
    from ft.attention.triton_paged import TritonAttention

    torch.manual_seed(0)
    random.seed(0)
    batch, num_blocks = make_batch(specs, block_size)
    t = sum(q for _, q in specs)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, dtype=dtype, device="cuda")
    q = torch.randn(t, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(t, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(t, hkv, d, dtype=dtype, device="cuda")
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = TorchAttention().forward(q, k, v, ref_cache, batch, d**-0.5)
    got = TritonAttention().forward(q, k, v, got_cache, batch, d**-0.5)
    torch.cuda.synchronize()
    assert torch.equal(got_cache, ref_cache), "KV store wrote different slots than the reference"
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


DECODE_CTX = [0, 1, 15, 16, 17, 100, 1000, 2500]


@gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("rep", [1, 2, 8])
def test_attention_decode(d, rep):
    run_attention([(c, 1) for c in DECODE_CTX], 2 * rep, 2, d, torch.bfloat16)


@pytest.fixture(params=["triton", "gluon", "gluon-ws"])
def extend_kernel(request, monkeypatch):
    """The extend kernel a test runs: Triton's, the Gluon one (``triton_paged.GLUON_EXTEND``) or its
    warp-specialised form (``gluon_extend_ws.WS``; a wrong mbarrier phase hangs it: run these under a
    `timeout`), the Gluon ones skipped where they do not run (not a Hopper GPU)."""
    from ft.attention import gluon_extend_ws, triton_paged

    gluon = request.param != "triton"
    if gluon and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon extend kernel runs on Hopper")
    monkeypatch.setattr(triton_paged, "GLUON_EXTEND", gluon)
    monkeypatch.setattr(gluon_extend_ws, "WS", request.param == "gluon-ws")
    return request.param


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rep", [1, 2, 8])
def test_attention_extend(d, rep, extend_kernel):
    specs = [(0, 37), (5, 1), (16, 64), (100, 130), (0, 1), (300, 7), (33, 200), (1000, 300), (0, 700)]
    run_attention(specs, 2 * rep, 2, d, torch.bfloat16)


@gpu
@pytest.mark.parametrize("d", [128, 256])
def test_attention_extend_short_queries(d, extend_kernel):
    """Chunks under 128 tokens take the 64-row tiles (``_extend_config``)."""
    run_attention([(0, 37), (5, 1), (16, 64), (90, 100), (0, 2)], 16, 2, d, torch.bfloat16)


@gpu
@pytest.mark.parametrize("ws", [False, True], ids=["gluon", "gluon-ws"])
@pytest.mark.parametrize("page", [16, 64])
def test_gluon_extend_long_chunk_matches_triton(page, ws, monkeypatch):
    """A 4k chunk after 3,000 cached tokens (Qwen3-Next's 16 q / 2 kv heads of 256) through both
    kernels: every tile kind (whole, diagonal, the last partial one) over many pages, the Gluon
    kernel taken (``supports``)."""
    pytest.importorskip("triton")
    from ft.attention import gluon_extend, gluon_extend_ws, triton_paged

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon extend kernel runs on Hopper")
    torch.manual_seed(0)
    random.seed(0)
    ctx, t, hq, hkv, d = 3000, 4100, 16, 2, 256
    batch, num_blocks = make_batch([(ctx, t)], page)
    cache = torch.randn(2, num_blocks, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(t, hq, d, dtype=torch.bfloat16, device="cuda")
    args = (q, cache, batch.block_tables, batch.cu_seqlens, batch.context_lens, t, d**-0.5)
    assert gluon_extend.supports(q, cache, batch.block_tables)
    monkeypatch.setattr(triton_paged, "GLUON_EXTEND", False)
    monkeypatch.setattr(gluon_extend_ws, "WS", ws)
    want = triton_paged.paged_extend(*args)
    got = gluon_extend.launch(*args[:-1], d**-0.5 * triton_paged.LOG2E, triton_paged._cache_strides(cache))
    torch.cuda.synchronize()
    assert rel_err(got, want) < 1e-2, rel_err(got, want)


@gpu
@pytest.mark.parametrize(
    "dtype, d, block_size",
    [(torch.float16, 16, 32), (torch.float32, 32, 16), (torch.float16, 64, 16), (torch.float32, 64, 64)],
)
def test_attention_small_heads_and_dtypes(dtype, d, block_size):
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    run_attention([(0, 20), (40, 1), (7, 9)], 4, 2, d, dtype, block_size, tol)  # extend
    run_attention([(c, 1) for c in (0, 3, 70, 333)], 4, 1, d, dtype, block_size, tol)  # decode


@gpu
@pytest.mark.parametrize("num_splits", [1, 2, 16, 128])
def test_attention_decode_split_counts(num_splits):
    pytest.importorskip("triton")
    from ft.attention.torch_ref import TorchAttention
    from ft.attention.triton_paged import paged_decode

    torch.manual_seed(1)
    # 128 splits of the 5,000-token row: 79 of 64 keys, three chunks of the combine's
    batch, num_blocks = make_batch([(c, 1) for c in (0, 9, 64, 700, 4999)], 16)
    cache = torch.randn(2, num_blocks, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(5, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(5, 2, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    ref = TorchAttention().forward(q, k, v, cache, batch, 0.1)  # also writes the new k/v
    got = paged_decode(q, cache, batch.block_tables, batch.seq_lens, 0.1, num_splits=num_splits)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- GDN

HK, HV, DK, DV, KC = 4, 8, 128, 128, 4
CONV_C = 2 * HK * DK + HV * DV


def gdn_inputs(t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    q, k, v = rn(t, HK, DK), rn(t, HK, DK), rn(t, HV, DV)
    decay = F.logsigmoid(rn(t, HV, dtype=torch.float32) + 3.0)  # log decay in (-inf, 0)
    beta = torch.sigmoid(rn(t, HV, dtype=torch.float32))
    return q, k, v, decay, beta


def gdn_pools(num_slots: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    conv = torch.randn(num_slots, CONV_C, KC - 1, generator=g, device="cuda").to(torch.bfloat16)
    ssm = 0.1 * torch.randn(num_slots, HV, DK, DV, generator=g, device="cuda")
    return conv, ssm


def run_gdn_step(backend, batch, pools, seed):
    conv_state, ssm_state = pools
    t = batch.positions.shape[0]
    x = torch.randn(t, CONV_C, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
    weight = torch.randn(CONV_C, KC, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    mixed = backend.conv(x.to(torch.bfloat16), weight.to(torch.bfloat16), conv_state, batch)
    q, k, v, decay, beta = gdn_inputs(t, seed)
    o = backend.delta_rule(q, k, v, decay, beta, ssm_state, batch)
    return mixed, o


def compare_gdn(specs, slots, num_slots=8, steps=1):
    pytest.importorskip("fla")
    from ft.gdn.fla_backend import FlaGDN
    from ft.gdn.torch_ref import TorchGDN

    ref_pools = gdn_pools(num_slots, 3)
    got_pools = tuple(p.clone() for p in ref_pools)
    fla, ref = FlaGDN(), TorchGDN()
    for step in range(steps):
        step_specs = [(c + step * q, q) for c, q in specs]
        batch, _ = make_batch(step_specs, 16, state_slots=slots)
        ref_mixed, ref_o = run_gdn_step(ref, batch, ref_pools, seed=10 + step)
        got_mixed, got_o = run_gdn_step(fla, batch, got_pools, seed=10 + step)
        torch.testing.assert_close(got_mixed.float(), ref_mixed.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(got_pools[0], ref_pools[0]), "conv_state update differs from the reference"
        assert rel_err(got_o, ref_o) < 2e-2, f"step {step}: output rel err {rel_err(got_o, ref_o):.3g}"
        assert rel_err(got_pools[1], ref_pools[1]) < 2e-2, "ssm_state differs from the reference"
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(got_pools[1][untouched], ref_pools[1][untouched]), "slots outside the batch changed"


@gpu
def test_gdn_prefill_varlen_fresh():
    compare_gdn([(0, 37), (0, 64), (0, 1), (0, 130), (0, 2)], slots=[3, 0, 5, 2, 6])


@gpu
def test_gdn_extend_with_initial_state():
    compare_gdn([(16, 37), (0, 64), (3, 1), (200, 130), (9, 2)], slots=[3, 0, 5, 2, 6])


@gpu
def test_gdn_short_varlen_takes_the_recurrent_kernel():
    # every sequence <= RECURRENT_MAX_TOKENS: fla's fused recurrent kernel over cu_seqlens
    from ft.gdn.fla_backend import RECURRENT_MAX_TOKENS

    compare_gdn(
        [(16, 5), (0, RECURRENT_MAX_TOKENS), (3, 1), (200, 9), (0, 2)], slots=[3, 0, 5, 2, 6], steps=2
    )


@gpu
def test_gdn_decode_steps():
    compare_gdn([(5, 1), (0, 1), (40, 1), (1, 1)], slots=[7, 1, 4, 2], steps=3)


@gpu
def test_gdn_chunked_equals_one_shot():
    pytest.importorskip("fla")
    from ft.gdn.fla_backend import FlaGDN

    fla, n = FlaGDN(), 200
    weight = torch.randn(CONV_C, KC, device="cuda").to(torch.bfloat16)
    x = torch.randn(n, CONV_C, device="cuda").to(torch.bfloat16)
    q, k, v, decay, beta = gdn_inputs(n, 5)
    outs = {}
    for name, chunks in {"one": [n], "chunked": [70, 1, 2, 127]}.items():
        conv_state, ssm_state = gdn_pools(2, 9)
        mixed, o, start = [], [], 0
        for c in chunks:
            batch, _ = make_batch([(start, c)], 16, state_slots=[1])
            s = slice(start, start + c)
            mixed.append(fla.conv(x[s], weight, conv_state, batch))
            o.append(fla.delta_rule(q[s], k[s], v[s], decay[s], beta[s], ssm_state, batch))
            start += c
        outs[name] = (torch.cat(mixed), torch.cat(o), conv_state[1], ssm_state[1])
    for a, b in zip(outs["chunked"], outs["one"]):
        assert rel_err(a, b) < 1e-2, f"chunked vs one-shot rel err {rel_err(a, b):.3g}"


# ---------------------------------------------------------------- MoE


def moe_case(t, e, inter, h, topk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device="cuda") * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=g, device="cuda") * inter**-0.5).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=g, device="cuda")
    weights, ids = torch.softmax(logits, -1).topk(topk, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def check_moe(t, e, inter, h, topk):
    pytest.importorskip("triton")
    from ft.moe.kernels.torch_ref import fused_moe_ref
    from ft.moe.kernels.triton_moe import fused_moe_triton

    x, w13, w2, weights, ids = moe_case(t, e, inter, h, topk)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.shape == (t, h) and got.dtype == torch.bfloat16
    err = rel_err(got, ref)
    assert err < 2e-2, f"T={t} E={e} I={inter}: relative error {err:.3g}"


@gpu
@pytest.mark.parametrize("t", [1, 4, 16, 64, 4096])
def test_moe_qwen3_next(t):
    check_moe(t, 512, 512, 2048, 10)


@gpu
@pytest.mark.parametrize("inter", [256, 128])
@pytest.mark.parametrize("t", [3, 300])
def test_moe_tp_shards(t, inter):
    check_moe(t, 512, inter, 2048, 10)


@gpu
@pytest.mark.parametrize("t", [1, 16, 512])
def test_moe_qwen3_30b(t):
    check_moe(t, 128, 768, 2048, 8)


@gpu
@pytest.mark.parametrize("small", [0, 1024])  # torch ops / one Triton program
@pytest.mark.parametrize("e, block_m", [(64, 16), (100, 32)])
def test_moe_align_covers_every_pair_once(small, e, block_m):
    pytest.importorskip("triton")
    from ft.moe.kernels.align import align_by_expert

    ids = torch.rand(50, e, device="cuda").topk(6, dim=-1).indices
    sorted_ids, block_expert, num_padded = align_by_expert(ids, e, block_m, small=small)
    used = sorted_ids[: int(num_padded)]
    real = used[used < ids.numel()]
    assert torch.equal(real.sort().values, torch.arange(ids.numel(), device="cuda"))
    experts = block_expert[: int(num_padded) // block_m].repeat_interleave(block_m)
    keep = used < ids.numel()
    assert torch.equal(ids.reshape(-1)[used[keep]], experts[keep]), "pair sorted under the wrong expert"


# ---------------------------------------------------------------- RMSNorm


@gpu
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(37, 2048), (5, 16, 128), (3, 1000)])
def test_rms_norm(shape, zero_centered):
    pytest.importorskip("triton")
    from ft.layers.norm import RMSNorm
    from ft.layers.triton_norm import rms_norm

    d = shape[-1]
    norm = RMSNorm(d, 1e-6, zero_centered).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d) * 0.1 + (0.0 if zero_centered else 1.0))
    w = norm.weight.data.to(torch.bfloat16)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    r = torch.randn(shape, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-6, zero_centered), norm(x), atol=2e-2, rtol=1e-2)
        out, h = rms_norm(x, w, 1e-6, zero_centered, residual=r)
        assert torch.equal(h, x + r)
        torch.testing.assert_close(out, norm(x + r), atol=2e-2, rtol=1e-2)
