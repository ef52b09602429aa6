"""The fused GDN decode kernel and the gate kernel against the torch reference, and a mixer decode
step through FlaGDN against TorchGDN, on fresh random inputs.

Marked ``gpu``; triton and fla are imported inside the tests. The helpers take a device so that
the same checks run on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from ft.forward_context import ForwardBatch, ForwardContext, forward_context

gpu = pytest.mark.gpu


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_batch(specs, slots, device) -> ForwardBatch:
    """specs [(context_len, query_len)], one GDN state slot per sequence (no KV cache needed)."""

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    n, total = len(specs), sum(q for _, q in specs)
    cu = [0]
    for _, q in specs:
        cu.append(cu[-1] + q)
    return ForwardBatch(
        positions=t([c + i for c, q in specs for i in range(q)], torch.int64),
        cu_seqlens=t(cu, torch.int32),
        context_lens=t([c for c, _ in specs], torch.int32),
        seq_lens=t([c + q for c, q in specs], torch.int32),
        block_tables=torch.zeros(n, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=device),
        state_slots=t(slots, torch.int64),
        prev_token_ids=torch.full((n, 0), -1, dtype=torch.int64, device=device),
        block_size=16,
        query_lens_cpu=[q for _, q in specs],
        context_lens_cpu=[c for c, _ in specs],
    )


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def torch_gates(b, a, A_log, dt_bias):
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b.float())


def decode_inputs(n, hk, dk, dv, dtype, device, seed=0):
    """Non-contiguous views like the model's: mixed is a column range of a wider tensor, b and a
    split one projection, a additionally strided; a few gate inputs sit in softplus's edge regions."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    hv = 2 * hk
    width = 2 * hk * dk + hv * dv
    mixed = rn(n, width + 24).to(dtype)[:, 8 : 8 + width]
    ba = (3 * rn(n, 4 * hv)).to(dtype)
    ba[0, 2 * hv] = 30.0  # softplus's linear region (above 20)
    ba[-1, -2] = -40.0  # e^x far below fp32's epsilon
    b, a = ba[:, :hv], ba[:, 2 * hv :: 2]
    return mixed, b, a, 0.5 * rn(hv), rn(hv)


def reference_decode(mixed, b, a, A_log, dt_bias, pool, batch, hk, dk):
    from ft.gdn.torch_ref import TorchGDN

    n, hv, dv = mixed.shape[0], pool.shape[1], pool.shape[-1]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g, beta = torch_gates(b, a, A_log, dt_bias)
    qkv = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    return TorchGDN().delta_rule(*qkv, g, beta, pool, batch)


def check_decode(n, hk, dk, dtype, device="cuda", seed=0):
    from ft.gdn.triton_decode import gdn_recurrent

    dv, hv = dk, 2 * hk
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    num_slots = n + 5
    pool = 0.1 * torch.randn(num_slots, hv, dk, dv, generator=gen, device=device)
    slots = torch.randperm(num_slots, generator=gen, device=device)[:n].tolist()
    ctx = torch.randint(1, 100, (n,), generator=gen, device=device).tolist()
    ctx[1::3] = [0] * len(ctx[1::3])  # fresh sequences: their slots hold stale state that must not leak in
    batch = make_batch([(c, 1) for c in ctx], slots, device)
    inputs = decode_inputs(n, hk, dk, dv, dtype, device, seed)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = reference_decode(*inputs, ref_pool, batch, hk, dk)
    got = gdn_recurrent(*inputs, got_pool, batch)
    assert got.shape == (n, hv, dv) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_pool, ref_pool, atol=1e-4, rtol=1e-4)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(got_pool[untouched], pool[untouched]), "slots outside the batch changed"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, hk, dk", [(1, 2, 128), (3, 4, 128), (64, 16, 128), (3, 2, 64), (64, 8, 64)])
def test_decode_matches_reference(n, hk, dk, dtype):
    pytest.importorskip("triton")
    check_decode(n, hk, dk, dtype)


def check_padded_rows(device="cuda"):
    """CUDA-graph padding: extra rows share the scratch slot with context 0; a negative slot
    touches no state and gives o = 0. Real rows are unaffected either way."""
    from ft.gdn.triton_decode import gdn_recurrent

    hk, dk, real, scratch = 2, 64, 3, 7
    pool = 0.1 * torch.randn(8, 2 * hk, dk, dk, device=device)
    slots, ctx = [4, 0, 2, scratch, scratch, -1], [5, 0, 9, 0, 0, 0]
    batch = make_batch([(c, 1) for c in ctx], slots, device)
    inputs = decode_inputs(len(slots), hk, dk, dk, torch.bfloat16, device)
    got_pool = pool.clone()
    got = gdn_recurrent(*inputs, got_pool, batch)
    ref_pool = pool.clone()
    ref = reference_decode(*(x[:real] for x in inputs[:3]), *inputs[3:], ref_pool, make_batch(
        [(c, 1) for c in ctx[:real]], slots[:real], device), hk, dk)  # fmt: skip
    torch.testing.assert_close(got[:real].float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_pool[slots[:real]], ref_pool[slots[:real]], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[-1], torch.zeros_like(got[-1])), "a row with a negative slot must give o = 0"
    others = [s for s in range(8) if s not in slots]
    assert torch.equal(got_pool[others], pool[others]), "padded rows wrote outside the scratch slot"


@gpu
def test_decode_padded_rows():
    pytest.importorskip("triton")
    check_padded_rows()


def check_recurrent(specs, hk, dk, dtype, device="cuda", seed=0):
    """Short varlen sequences (a prefix-cache snapshot's tail, small chunks): each program walks
    its sequence's tokens in order, from its slot (or zeros) to the slot."""
    from ft.gdn.triton_decode import gdn_recurrent

    dv, hv, n = dk, 2 * hk, len(specs)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    num_slots = n + 3
    pool = 0.1 * torch.randn(num_slots, hv, dk, dv, generator=gen, device=device)
    slots = torch.randperm(num_slots, generator=gen, device=device)[:n].tolist()
    batch = make_batch(specs, slots, device)
    inputs = decode_inputs(sum(q for _, q in specs), hk, dk, dv, dtype, device, seed)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = reference_decode(*inputs, ref_pool, batch, hk, dk)
    got = gdn_recurrent(*inputs, got_pool, batch)
    assert got.shape == ref.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_pool, ref_pool, atol=1e-4, rtol=1e-4)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(got_pool[untouched], pool[untouched]), "slots outside the batch changed"


RECURRENT_SPECS = [(16, 5), (0, 16), (3, 1), (200, 9), (0, 2)]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk, dk", [(2, 128), (4, 64)])
def test_recurrent_varlen_matches_reference(hk, dk, dtype):
    pytest.importorskip("triton")
    check_recurrent(RECURRENT_SPECS, hk, dk, dtype)


def check_gates(t, hv, device="cuda"):
    from ft.gdn.triton_decode import gdn_gates

    _, b, a, A_log, dt_bias = decode_inputs(t, hv // 2, 16, 16, torch.bfloat16, device)
    g, beta = gdn_gates(b, a, A_log, dt_bias)
    ref_g, ref_beta = torch_gates(b, a, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == (t, hv)
    torch.testing.assert_close(g, ref_g, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(beta, ref_beta, atol=1e-6, rtol=1e-5)


@gpu
@pytest.mark.parametrize("t, hv", [(1, 4), (77, 32), (1000, 6)])
def test_gates_match_torch(t, hv):
    pytest.importorskip("triton")
    check_gates(t, hv)


# ---------------------------------------------------------------- the mixer


def build_mixer(kind: str, device, seed=0):
    """A tiny Qwen3-Next or qwen4_exp GDN layer (dk = dv = 64) with random weights, bf16."""
    from ft.distributed import TPInfo, tp_context
    from ft.models.qwen3_next import Qwen3NextGatedDeltaNet
    from ft.models.qwen4_exp.gdn import Qwen4ExpGatedDeltaNet

    cls = {"qwen3_next": Qwen3NextGatedDeltaNet, "qwen4_exp": Qwen4ExpGatedDeltaNet}[kind]
    cfg = types.SimpleNamespace(
        hidden_size=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with tp_context(TPInfo(0, 1)), torch.device(device):
            mixer = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in mixer.named_parameters():
        scale = 1.0 if name in ("A_log", "dt_bias") or "norm" in name else p.shape[-1] ** -0.5
        p.copy_(scale * torch.randn(p.shape, generator=gen, device=device))
    num_slots = 6
    conv_shape, ssm_shape = mixer.state_shapes()
    mixer.conv_state = torch.randn(num_slots, *conv_shape, generator=gen, device=device).to(torch.bfloat16)
    mixer.ssm_state = 0.1 * torch.randn(num_slots, *ssm_shape, generator=gen, device=device)
    return mixer


def run_mixer(mixer, gdn, steps, device):
    """steps: [(specs, slots)] run in order; returns each step's output."""
    outs = []
    for i, (specs, slots) in enumerate(steps):
        batch = make_batch(specs, slots, device)
        x = torch.randn(batch.positions.shape[0], 64, generator=torch.Generator(device=device).manual_seed(i),
                        device=device).to(torch.bfloat16)  # fmt: skip
        with forward_context(ForwardContext(batch, None, gdn)):
            outs.append(mixer(batch.positions, x))
    return outs


MIXER_STEPS = [  # a prefill (chunked path), then decodes with a fresh sequence joining
    ([(0, 7), (3, 20), (0, 1)], [1, 4, 0]),
    ([(7, 1), (23, 1), (1, 1)], [1, 4, 0]),
    ([(8, 1), (24, 1), (2, 1), (0, 1)], [1, 4, 0, 3]),
    ([(9, 1), (25, 1), (3, 1), (1, 1)], [1, 4, 0, 3]),
]


def check_mixer(kind, fused_gdn, device="cuda"):
    import ft.gdn.fla_backend as fla_backend
    from ft.gdn.torch_ref import TorchGDN

    ref_mixer, got_mixer = build_mixer(kind, device), build_mixer(kind, device)
    fused_calls = []
    decode = fla_backend.gdn_recurrent
    fla_backend.gdn_recurrent = lambda *args: fused_calls.append(1) or decode(*args)
    try:
        with torch.inference_mode():
            ref = run_mixer(ref_mixer, TorchGDN(), MIXER_STEPS, device)
            got = run_mixer(got_mixer, fused_gdn, MIXER_STEPS, device)
    finally:
        fla_backend.gdn_recurrent = decode
    assert len(fused_calls) == len(MIXER_STEPS) - 1, "decode steps did not take the fused kernel"
    for step, (r, g) in enumerate(zip(ref, got)):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert rel_err(g, r) < 2e-2, f"step {step}: mixer output rel err {rel_err(g, r):.3g}"
    assert rel_err(got_mixer.ssm_state, ref_mixer.ssm_state) < 2e-2, "ssm_state differs from TorchGDN"
    torch.testing.assert_close(got_mixer.conv_state, ref_mixer.conv_state, atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen4_exp"])
def test_mixer_decode_fla_equals_torch(kind):
    pytest.importorskip("fla")
    from ft.gdn.fla_backend import FlaGDN

    check_mixer(kind, FlaGDN())


@gpu
@pytest.mark.parametrize("n", [1, 5, 64])
def test_conv_decode_in_one_launch_equals_two(n, monkeypatch):
    """``triton_conv.DECODE_ONE_LAUNCH``: a decode batch's conv and history shift in one kernel
    give the two kernels' bits (bf16, Qwen3-Next's 8,192 channels), eagerly and replayed from a
    CUDA graph, for sequences with and without context."""
    pytest.importorskip("triton")
    from ft.gdn import triton_conv

    c, kc = 8192, 4
    batch = make_batch([(i % 3, 1) for i in range(n)], list(range(n - 1, -1, -1)), "cuda")
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, c, generator=gen, device="cuda").to(torch.bfloat16)
    weight = torch.randn(c, kc, generator=gen, device="cuda").to(torch.bfloat16)
    state = torch.randn(n + 2, c, kc - 1, generator=gen, device="cuda").to(torch.bfloat16)
    results = []
    for one in (False, True):
        monkeypatch.setattr(triton_conv, "DECODE_ONE_LAUNCH", one)
        st = state.clone()
        results.append((triton_conv.causal_conv1d_silu(x, weight, st, batch, 1), st))
    (two_out, two_state), (one_out, one_state) = results
    assert torch.equal(one_out, two_out) and torch.equal(one_state, two_state)
    st = state.clone()
    triton_conv.causal_conv1d_silu(x, weight, st.clone(), batch, 1)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_conv.causal_conv1d_silu(x, weight, st, batch, 1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, two_out) and torch.equal(st, two_state)


@pytest.mark.parametrize("b", [1, 3, 4])
def test_projection_with_the_conv_equals_the_gemv_then_the_conv(b):
    """``triton_conv_proj.launch_proj_conv`` (``CONV_IN_PROJ``) at Qwen3-Next's in_proj (12352 x 2048,
    8192 conv channels, Kc 4): the GEMV then ``causal_conv1d_silu``'s decode kernel, bit for bit in
    the outputs and the histories, some sequences without context; in a CUDA graph with new inputs
    likewise."""
    pytest.importorskip("triton")
    from ft.gdn import triton_conv_proj
    from ft.gdn.triton_conv import causal_conv1d_silu
    from ft.layers import triton_gemv

    g = torch.Generator(device="cuda").manual_seed(b)
    n, k, c, kc = 12352, 2048, 8192, 4
    x = torch.randn(b, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    conv_w = torch.randn(c, kc, generator=g, device="cuda").to(torch.bfloat16)
    state = torch.randn(b + 2, c, kc - 1, generator=g, device="cuda").to(torch.bfloat16)
    batch = make_batch([(0 if i == 0 else 5 + i, 1) for i in range(b)], [b + 1 - i for i in range(b)], "cuda")

    def separate(x, st):
        y = triton_gemv.gemv(x, w)
        return torch.cat([causal_conv1d_silu(y[:, :c], conv_w, st, batch, 1), y[:, c:]], dim=1)

    def fused(x, st):
        return triton_conv_proj.launch_proj_conv(x, w, conv_w, st, batch.context_lens, batch.state_slots)

    want_state, got_state = state.clone(), state.clone()
    assert torch.equal(fused(x, got_state), separate(x, want_state))
    assert torch.equal(got_state, want_state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x, got_state)
    x.copy_(torch.randn(b, k, generator=g, device="cuda").to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, separate(x, want_state)) and torch.equal(got_state, want_state)
