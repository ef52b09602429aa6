"""The GEMV MoE path for decode sizes (``triton_moe_gemv``) equals the torch references and the MMA
kernels on the GPU (marker ``gpu``), for bf16 and NVFP4 banks: Qwen3-Next's shape (512 experts,
H=2048, I=512, top-10) at T = 1..16, a tensor-parallel I=256 shard and an I whose K tail is not a
whole step, the dispatch by token count, and CUDA-graph capture with the experts read on the device."""

from __future__ import annotations

import pytest
import torch

from tests.nvfp4.test_w4a16_gpu import random_bank, rel_err, routing

pytestmark = pytest.mark.gpu


def problem(fmt: str, t: int, e: int, inter: int, h: int, topk: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "nvfp4":
        w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
    else:
        w13 = (torch.randn(e, 2 * inter, h, generator=gen, device="cuda") * h**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, h, inter, generator=gen, device="cuda") * inter**-0.5).to(torch.bfloat16)
    x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, e, topk, gen)
    return x, w13, w2, weights, ids


def shared_pair(t: int, inter: int, seed: int, h: int = 2048) -> tuple:
    """A bf16 shared expert's (gate_up [2I, H], down [H, I], gate logit [T, 1]) on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (
        (torch.randn(2 * inter, h, generator=gen, device="cuda") * h**-0.5).to(torch.bfloat16),
        (torch.randn(h, inter, generator=gen, device="cuda") * inter**-0.5).to(torch.bfloat16),
        torch.randn(t, 1, generator=gen, device="cuda").to(torch.bfloat16),
    )


def mma_module(fmt: str):
    from ft.moe.kernels import triton_moe, triton_w4a16

    return (
        (triton_w4a16, triton_w4a16.fused_moe_w4a16)
        if fmt == "nvfp4"
        else (triton_moe, triton_moe.fused_moe_triton)
    )


def reference(fmt: str, x, w13, w2, weights, ids):
    if fmt == "nvfp4":
        from ft.moe.kernels.nvfp4_torch import fused_moe_nvfp4_ref

        return fused_moe_nvfp4_ref(x.float(), w13, w2, weights, ids)
    from ft.moe.kernels.torch_ref import fused_moe_ref

    hit = ids.unique()  # only the hit experts in fp32, renumbered
    local = torch.searchsorted(hit, ids)
    return fused_moe_ref(x.float(), w13[hit].float(), w2[hit].float(), weights, local)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("inter", [512, 256, 48])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16, 32, 64])
def test_gemv_equals_reference_and_mma_kernel(fmt, t, inter, monkeypatch):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv

    x, w13, w2, weights, ids = problem(fmt, t, 512, inter, 2048, 10, seed=t + inter)
    got = fused_moe_gemv(x, w13, w2, weights, ids)
    assert got.shape == (t, 2048) and got.dtype == torch.bfloat16
    err = rel_err(got, reference(fmt, x, w13, w2, weights, ids))
    assert err < 2e-2, f"{fmt} T={t} I={inter}: relative error {err:.3g} against the torch reference"
    module, mma = mma_module(fmt)
    monkeypatch.setattr(module, "GEMV_MAX_TOKENS", 0)  # the MMA path, whatever the default
    # same bf16 rounding of act; the MMA path also rounds each pair's term before the sum over k
    err = rel_err(got, mma(x, w13, w2, weights, ids))
    assert err < 4e-3, f"{fmt} T={t} I={inter}: relative error {err:.3g} against the MMA kernel"


@pytest.mark.parametrize("words", ["gate/up", "both"])
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("h", [2048, 2880])
def test_nvfp4_codes_as_words_equal_bytes(t, h, words, monkeypatch):
    """``FP4_PLANES`` (the gate/up kernel's NVFP4 codes decoded from 32-bit words, a block's scale
    once; with ``FP4_DOWN_PLANES`` the down kernel too)
    against the byte-wise decode, within one bf16 step, and the torch reference: H = 2048 whole
    steps, 2880 five steps of 512 and a tail of 320."""
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_moe_gemv

    x, w13, w2, weights, ids = problem("nvfp4", t, 64, 256, h, 8, seed=h + t)
    monkeypatch.setattr(triton_moe_gemv, "FP4_INT_DOT", False)  # the words' own products (its own test)
    monkeypatch.setattr(triton_moe_gemv, "FP4_PLANES", False)
    monkeypatch.setattr(triton_moe_gemv, "FP4_DOWN_PLANES", False)
    want = triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids).float()
    monkeypatch.setattr(triton_moe_gemv, "FP4_PLANES", True)
    monkeypatch.setattr(triton_moe_gemv, "FP4_DOWN_PLANES", words == "both")
    got = triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids).float()
    step = want.abs().clamp(min=1e-3) * 2**-7
    assert ((got - want).abs() <= step).all(), f"T={t} H={h} words {words}: words and bytes disagree"
    err = rel_err(got, reference("nvfp4", x, w13, w2, weights, ids))
    assert err < 2e-2, f"T={t} H={h} words {words}: relative error {err:.3g} against the torch reference"


def quantize_blocks_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int_dot.quantize_blocks`` in torch: each 16-wide block times 2^(14 - E), E its
    largest magnitude's exponent clamped to [-96, 127], to the nearest integer (halves away from
    zero); the factor 2^(E - 29)."""
    t, k = x.shape
    v = x.float().view(t, k // 16, 16)
    top = v.abs().amax(-1)
    e = torch.frexp(top)[1] - 1  # frexp: m · 2^e with m in [0.5, 1)
    e = torch.where(top == 0, -127, e).clamp(min=-96, max=127)  # zero: the kernel reads exponent bits 0
    q = v * torch.exp2(14 - e.float())[..., None]
    q = torch.trunc(q + torch.where(q >= 0, 0.5, -0.5))
    return q.to(torch.int16).view(t, k), torch.exp2(e.float() - 29)


def test_int8_codes_and_dp2a_equal_their_arithmetic():
    """``FP4_INT_DOT``'s PTX (``prmt`` from the code table, ``dp2a``) gives the bits of the same
    steps written as integer arithmetic (what the interpreter runs): every code in every nibble,
    random words, pairs and accumulators."""
    pytest.importorskip("triton")
    from tests.gpu.int_dot_probe import int_dot_steps

    gen = torch.Generator(device="cuda").manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (1024,), generator=gen, device="cuda", dtype=torch.int64)
    words[:16] = torch.arange(16, device="cuda") * 0x11111111  # each code in all eight nibbles
    words = words.to(torch.int32)
    pairs = torch.randint(-(2**31), 2**31, (1024,), generator=gen, device="cuda", dtype=torch.int64).int()
    acc = torch.randint(-(2**20), 2**20, (1024,), generator=gen, device="cuda", dtype=torch.int32)
    outs = []
    for asm in (True, False):
        out = torch.empty(6 * 1024, dtype=torch.int32, device="cuda")
        int_dot_steps[(1,)](words, pairs, acc, out, N=1024, ASM=asm)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    table = [0, 1, 2, 3, 4, 6, 8, 12]  # 2 · e2m1, by the code's magnitude bits
    first = outs[0].view(6, 1024)[:4, :16].contiguous().cpu().view(torch.uint8).view(4, 16, 4)
    for code in range(16):  # all four bytes of each word are this code's
        pos, neg = (table[code & 7], 0) if code < 8 else (0, table[code & 7])
        assert (first[:2, code] == pos).all() and (first[2:, code] == neg).all(), code


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("h", [2048, 2880])
def test_nvfp4_integer_products(t, h, shared, monkeypatch):
    """``FP4_INT_DOT`` (gate/up's products as int16 inputs times int8 codes, ``dp2a``): the inputs'
    blocks as the torch rule makes them, bit for bit; the call within one bf16 step of the words
    and within bf16 error of the torch reference, with the bf16 shared pair too; H = 2048 whole
    steps, 2880 five steps of 512 and a tail of 320."""
    pytest.importorskip("triton")
    from ft.moe.kernels import int_dot, triton_moe_gemv

    x, w13, w2, weights, ids = problem("nvfp4", t, 64, 256, h, 8, seed=h + t + 7)
    x[0, :16] = torch.tensor([2.0**-100, -(2.0**-120)] + [0.0] * 14)  # a block clamped to 2^-96
    x[0, 16:32] = 0.0
    x[-1, 32:48] = torch.logspace(-8, 6, 16, base=2)  # a block spanning 2^14: its small inputs rounded
    for got, want in zip(int_dot.quantize_blocks(x), quantize_blocks_ref(x)):
        assert torch.equal(got, want)
    pair = None
    if shared:
        gen = torch.Generator(device="cuda").manual_seed(t)
        s13 = (torch.randn(512, h, generator=gen, device="cuda") * h**-0.5).to(torch.bfloat16)
        s2 = (torch.randn(h, 256, generator=gen, device="cuda") * 256**-0.5).to(torch.bfloat16)
        pair = (s13, s2, torch.randn(t, 1, generator=gen, device="cuda").to(torch.bfloat16))
    monkeypatch.setattr(triton_moe_gemv, "FP4_INT_DOT", False)
    words = triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids, pair).float()
    monkeypatch.setattr(triton_moe_gemv, "FP4_INT_DOT", True)
    got = triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids, pair).float()
    # each output is a sum of bf16-rounded terms, some of which cancel: a rounding of act or of a
    # term (the fp32 order differs) moves an output by a term's ulp, many of a small output's
    # (within a row's largest magnitude · 2^-6)
    scale = words.abs().amax(1, keepdim=True)
    assert ((got - words).abs() <= scale * 2**-6).all(), f"T={t} H={h}: integer products and words disagree"
    if not shared:
        want = reference("nvfp4", x, w13, w2, weights, ids)
        err, err_words = rel_err(got, want), rel_err(words, want)
        assert err < 1.25 * err_words + 1e-3, f"T={t} H={h}: relative error {err:.3g}, words {err_words:.3g}"


@pytest.mark.parametrize("steps", [(0, 0), (0, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_shared_expert_as_one_more_pair(fmt, t, steps, monkeypatch):
    """A bf16 shared expert beside a bf16 or NVFP4 bank, run as one more pair of each token: the
    routed call plus sigmoid(logit) · the shared expert's MLP, within bf16 error; beside NVFP4 also
    with the shared rows' own steps (``NVFP4_SHARED_BK``, ``NVFP4_SHARED_BK_DOWN``)."""
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_moe_gemv
    from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv

    monkeypatch.setattr(triton_moe_gemv, "NVFP4_SHARED_BK", steps[0])
    monkeypatch.setattr(triton_moe_gemv, "NVFP4_SHARED_BK_DOWN", steps[1])

    x, w13, w2, weights, ids = problem(fmt, t, 512, 512, 2048, 10, seed=t)
    gen = torch.Generator(device="cuda").manual_seed(t)
    s13 = (torch.randn(1024, 2048, generator=gen, device="cuda") * 2048**-0.5).to(torch.bfloat16)
    s2 = (torch.randn(2048, 512, generator=gen, device="cuda") * 512**-0.5).to(torch.bfloat16)
    logit = torch.randn(t, 1, generator=gen, device="cuda").to(torch.bfloat16)
    got = fused_moe_gemv(x, w13, w2, weights, ids, shared=(s13, s2, logit))
    hid = x.float() @ s13.float().T
    mlp = (torch.nn.functional.silu(hid[:, :512]) * hid[:, 512:]) @ s2.float().T
    want = fused_moe_gemv(x, w13, w2, weights, ids).float() + torch.sigmoid(logit.float()) * mlp
    err = rel_err(got, want)
    assert err < 2e-2, f"{fmt} T={t}: relative error {err:.3g}"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_dispatch_by_token_count(fmt, monkeypatch):
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_moe_gemv

    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return gemv(*args)

    gemv = triton_moe_gemv.fused_moe_gemv
    monkeypatch.setattr(triton_moe_gemv, "fused_moe_gemv", spy)
    module, mma = mma_module(fmt)
    monkeypatch.setattr(module, "GEMV_MAX_TOKENS", 4)
    for t in (4, 5):
        x, w13, w2, weights, ids = problem(fmt, t, 64, 128, 256, 4, seed=t)
        assert mma(x, w13, w2, weights, ids).shape == (t, 256)
    assert calls == [4], f"only T <= GEMV_MAX_TOKENS should take the GEMV path, got calls for T in {calls}"
    if fmt == "bf16":  # experts wider than GEMV_MAX_INTER (Qwen3-30B's I=768) keep the MMA path
        x, w13, w2, weights, ids = problem(fmt, 1, 64, module.GEMV_MAX_INTER + 256, 256, 4, seed=9)
        assert mma(x, w13, w2, weights, ids).shape == (1, 256) and calls == [4]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cuda_graph_replays_new_tokens_and_experts(fmt):
    pytest.importorskip("triton")
    from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv

    x, w13, w2, weights, ids = problem(fmt, 2, 512, 512, 2048, 10, seed=11)
    fused_moe_gemv(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_gemv(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = problem(fmt, 2, 512, 512, 2048, 10, seed=12)
    for a, b in ((x, x2), (weights, weights2), (ids, ids2)):
        a.copy_(b)
    graph.replay()
    assert torch.equal(out, fused_moe_gemv(x2, w13, w2, weights2, ids2))
    graph.replay()  # the counters were reset by the last replay
    assert torch.equal(out, fused_moe_gemv(x2, w13, w2, weights2, ids2))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("t, inter", [(1, 512), (4, 512), (2, 768)])
def test_pipelined_loops_give_the_same_bits(fmt, t, inter, monkeypatch):
    """``triton_moe_gemv.PIPELINE`` (the loops' loads run ahead) changes no bit, with the shared
    expert as a pair and without, and the ticket counters are back at zero after each call."""
    from ft.layers import triton_gemv
    from ft.moe.kernels import triton_moe_gemv as mod

    x, w13, w2, weights, ids = problem(fmt, t, 512, inter, 2048, 10, seed=t)
    shared = shared_pair(t, inter, seed=5)
    for pair in (None, shared):
        outs = []
        for pipeline in (False, True):
            monkeypatch.setattr(mod, "PIPELINE", pipeline)
            outs.append(mod.fused_moe_gemv(x, w13, w2, weights, ids, pair))
            assert not triton_gemv.tickets(x.device).any(), "a ticket counter was left non-zero"
        assert torch.equal(outs[0], outs[1]), pair is not None


@pytest.mark.parametrize(
    "fmt,host_stages,host_tiles",
    [("bf16", None, False), ("bf16", None, True), ("nvfp4", None, False), ("nvfp4", (3, 2), False)],
)
@pytest.mark.parametrize("t", [1, 4])
def test_host_rows_read_in_place_equal_the_resident_bank(fmt, host_stages, host_tiles, t, monkeypatch):
    """``host=``: experts read from pinned host memory by the kernel (ids e < 0: host row -e - 1)
    give the bits of the call on a bank holding every expert on the device, graphed too; slots no
    expert holds and the host rows of slotted experts are NaN, so reading the wrong side fails.
    With ``NVFP4_HOST_STAGES`` the host-read launches pipeline more loads, with ``HOST_TILES`` the
    bf16 gate/up launch fewer: the same bits; so do host rows on the device (``host_stage``)."""
    pytest.importorskip("triton")
    from ft.moe.kernels import triton_moe_gemv
    from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv
    from ft.quant.nvfp4 import NVFP4Tensor

    monkeypatch.setattr(triton_moe_gemv, "NVFP4_HOST_STAGES", host_stages)
    monkeypatch.setattr(triton_moe_gemv, "HOST_TILES", host_tiles)

    e, slots = 512, 96
    x, w13, w2, weights, ids = problem(fmt, t, e, 512, 2048, 10, seed=40 + t)
    gen = torch.Generator(device="cuda").manual_seed(t)
    in_slot = torch.randperm(e, generator=gen, device="cuda")[: slots - 8]  # 8 slots left empty
    route = -(torch.arange(e, device="cuda") + 1)
    route[in_slot] = torch.randperm(slots, generator=gen, device="cuda")[: len(in_slot)]
    holder = torch.zeros(slots, dtype=torch.long, device="cuda")
    holder[route[in_slot]] = in_slot
    empty = torch.ones(slots, dtype=torch.bool, device="cuda")
    empty[route[in_slot]] = False

    def split(w):  # (device slot rows, pinned host rows)
        if isinstance(w, NVFP4Tensor):
            slot_g, host_g = w.weight_scale_2[holder].clone(), w.weight_scale_2.clone()
            slot_g[empty], host_g[in_slot] = float("nan"), float("nan")
            slot = NVFP4Tensor(w.weight[holder], w.weight_scale[holder], slot_g)
            host = NVFP4Tensor(*(p.cpu().pin_memory() for p in (w.weight, w.weight_scale, host_g)))
            return slot, host
        slot, host = w[holder].clone(), w.clone()
        slot[empty], host[in_slot] = float("nan"), float("nan")
        return slot, host.cpu().pin_memory()

    (s13, h13), (s2, h2) = split(w13), split(w2)
    want = fused_moe_gemv(x, w13, w2, weights, ids)
    rows = route[ids]
    got = fused_moe_gemv(x, s13, s2, weights, rows, host=(h13, h2))
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe_gemv(x, s13, s2, weights, rows, host=(h13, h2))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, want)
    # the host rows copied to the device (host staging's block): the resident tiles, the same bits
    on_device = [NVFP4Tensor(*(p.cuda() for p in w.parts)) if fmt == "nvfp4" else w.cuda() for w in (h13, h2)]
    assert torch.equal(fused_moe_gemv(x, s13, s2, weights, rows, host=on_device), want)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_unrolled_integer_gate_up_gives_the_same_bits(t, monkeypatch):
    """``triton_moe_gemv.GATE_UP_UNROLL`` (the integer gate/up loop unrolled) changes no bit."""
    from ft.moe.kernels import triton_moe_gemv as mod

    x, w13, w2, weights, ids = problem("nvfp4", t, 512, 512, 2048, 10, seed=30 + t)
    shared = shared_pair(t, 512, seed=8)
    monkeypatch.setattr(mod, "GATE_UP_UNROLL", 1)
    want = mod.fused_moe_gemv(x, w13, w2, weights, ids, shared)
    for unroll in (2, 4):
        monkeypatch.setattr(mod, "GATE_UP_UNROLL", unroll)
        assert torch.equal(mod.fused_moe_gemv(x, w13, w2, weights, ids, shared), want), unroll
