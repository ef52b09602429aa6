"""The layers' fused Triton paths against their own torch paths, on fresh random CUDA inputs: the
residual add + RMSNorm, the gated GDN norm, q/k norm + rope, the sigmoid output gate, and a
decoder stack (GDN and attention layers) run both ways.

The torch path is the same module with its fused hook switched off, so both sides see the same
tensors. bf16 must agree to a couple of ulps (the rounding points are the torch ones; only fp32
reduction order and cos/sin/exp ulps differ), fp32 to a few fp32 ulps. Marked ``gpu``.

The fused attention decode step (``triton_paged.FUSED_DECODE``: the cache write inside the q/k
norm + rope kernel, the gate inside the attention kernels) is held to the unfused Triton step bit
for bit instead, cache and output, eager and in a CUDA graph, and an engine's tokens and log-probs
with it on to those with it off.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ft.forward_context import ForwardBatch
from ft.layers import attention as attention_module
from ft.layers import norm as norm_module
from ft.layers import rotary as rotary_module

gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 300]
HOOKS = [
    (norm_module, "fused_rms_norm"),
    (norm_module, "fused_gated_rms_norm"),
    (rotary_module, "qk_norm_rope"),
    (attention_module, "fused_sigmoid_gate"),
]


@pytest.fixture
def torch_path(monkeypatch):
    """A context manager under which the layers take their torch path on CUDA tensors."""
    pytest.importorskip("triton")
    assert all(getattr(m, name) is not None for m, name in HOOKS), "triton imports but a fused hook is off"

    @contextlib.contextmanager
    def off():
        with monkeypatch.context() as m:
            for module, name in HOOKS:
                m.setattr(module, name, None)
            yield

    return off


def assert_ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Elementwise within k·eps·max(|want|, max|want| / 4), k = 4 for bf16 and 16 for fp32: a
    1-ulp flip of a bf16 intermediate (the normed x, rounded before · w) grows to ~3 ulps through
    the roundings after it, fp32 differs by reduction order, and the floor admits such a flip in
    values that cancel (rope). bf16 must moreover be bit-equal in all but 0.1% of the elements (or
    2): a rounding point other than torch's changes far more."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    k = (4 if want.dtype == torch.bfloat16 else 16) * torch.finfo(want.dtype).eps
    g, w = got.float(), want.float()
    err, tol = (g - w).abs(), k * w.abs().clamp_min(w.abs().max() / 4)
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), (
        f"{int((err > tol).sum())} of {err.numel()} elements off; worst got {g.flatten()[worst].item()} "
        f"want {w.flatten()[worst].item()}"
    )
    if want.dtype == torch.bfloat16:
        differ = int((got != want).sum())
        assert differ <= max(2, want.numel() // 1000), f"{differ} of {want.numel()} elements differ"


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_add_rms_norm(torch_path, dtype, t, zero_centered):
    h = 2048
    norm = norm_module.RMSNorm(h, 1e-6, zero_centered).cuda().to(dtype)
    norm.weight.data = rand(h, dtype=dtype, scale=0.2) + (0.0 if zero_centered else 1.0)
    x = rand(t, 2 * h, dtype=dtype)[:, h:]  # a row view, as a split projection gives
    r = rand(t, h, dtype=dtype, scale=4.0)
    with torch.no_grad():
        out, res = norm(x, r)
        plain = norm(x)
        with torch_path():
            want_out, want_res = norm(x, r)
            want_plain = norm(x)
    assert torch.equal(res, want_res), "the residual sum must round exactly as torch's add"
    assert_ulp_close(out, want_out)
    assert_ulp_close(plain, want_plain)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_gated_rms_norm(torch_path, dtype, t, fp32_weight):
    hv, dv = 8, 128
    norm = norm_module.GatedRMSNorm(dv, 1e-6).cuda()
    norm.weight.data = rand(dv, dtype=torch.float32 if fp32_weight else dtype, scale=0.2) + 1.0
    o = rand(t, hv, dv, dtype=dtype)
    proj = rand(t, 3 * hv * dv + 6, dtype=dtype, scale=3.0)
    z = proj[:, 2 * hv * dv + 6 :].view(t, hv, dv)  # a strided part of a projection, as GDN's z
    with torch.no_grad():
        got = norm(o, z)
        got_rows = norm(o.reshape(-1, dv), z.reshape(-1, dv))  # the [N, dv] form (reshape copies z)
        with torch_path():
            want = norm(o, z)
    assert got.is_contiguous()
    assert_ulp_close(got, want)
    assert torch.equal(got_rows.view(t, hv, dv), got)


# (head_dim, rotary_dim, Hq, Hkv, output_gate, zero_centred): Qwen3-Next, Qwen3-30B-A3B, a tiny one
ATTENTION = [(256, 64, 16, 2, True, True), (128, 128, 32, 4, False, False), (16, 8, 4, 1, True, False)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape", ATTENTION, ids=["next", "qwen3-30b", "tiny"])
def test_qk_norm_rope_and_gate(torch_path, dtype, t, shape):
    d, rot, hq, hkv, output_gate, zc = shape
    rope = rotary_module.RotaryEmbedding(d, rot, 1e7).cuda()
    norms = [norm_module.RMSNorm(d, 1e-6, zc).cuda().to(dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = rand(d, dtype=dtype, scale=0.2) + (0.0 if zc else 1.0)
    q_rows = 2 * d if output_gate else d
    qkv = rand(t, hq * q_rows + 2 * hkv * d, dtype=dtype, scale=2.0)
    q, k, _ = qkv.split([hq * q_rows, hkv * d, hkv * d], dim=-1)
    heads, k = q.view(t, hq, q_rows), k.view(t, hkv, d)
    positions = torch.randint(0, 100_000, (t,), device="cuda")
    positions[0] = 0
    with torch.no_grad():
        got_q, got_k = rope.norm_and_rotate(positions, heads[..., :d], k, *norms)
        with torch_path():
            want_q, want_k = rope.norm_and_rotate(positions, heads[..., :d], k, *norms)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert_ulp_close(got_q, want_q)
    assert_ulp_close(got_k, want_k)
    if output_gate:
        out = rand(t, hq, d, dtype=dtype)
        got = attention_module.sigmoid_gate(out, heads[..., d:])
        with torch_path():
            want = attention_module.sigmoid_gate(out, heads[..., d:])
        assert_ulp_close(got, want)


def attention_layer(shape, dtype: torch.dtype, hidden: int = 256) -> attention_module.QKNormAttention:
    """A QK-normed attention layer built as the engine builds one (parameters in ``dtype``, the
    rotary frequencies fp32), every parameter random."""
    from ft.distributed import TPInfo, tp_context

    d, rot, hq, hkv, output_gate, zc = shape
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with tp_context(TPInfo(0, 1)), torch.device("cuda"):
            layer = attention_module.QKNormAttention(hidden, hq, hkv, d, rot, 1e7, 1e-6, zc, output_gate)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() < 2:
                p.copy_(torch.randn(p.shape) * 0.2 + (0.0 if zc else 1.0))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return layer


def count_calls(monkeypatch, targets) -> list[str]:
    """Wrap each (module, name) so that a call appends its name to the list returned."""
    calls: list[str] = []
    for module, name in targets:
        fn = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw)
        )
    return calls


@gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("splits", [1, 4, None], ids=["1split", "4splits", "auto"])
# fp16 beside bf16: both take the 16-bit kernels' tiles (fp32 heads of 256 were never tried here)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", ATTENTION, ids=["next", "qwen3-30b", "tiny"])
def test_fused_attention_decode_step(monkeypatch, shape, dtype, splits, graph):
    """A decode step of the layer with ``FUSED_DECODE`` leaves the same KV cache and returns the
    same output as without, bit for bit: five real sequences (one at context 0) and two padding
    rows (slot -1), KV splits as chosen or forced; the unfused launches are not made."""
    pytest.importorskip("triton")
    from ft.attention import triton_paged
    from ft.forward_context import ForwardContext, forward_context
    from tests.test_attention_fusions_interp import PAGE, decode_batch

    torch.manual_seed(0)
    d, hkv = shape[0], shape[3]
    layer = attention_layer(shape, dtype)
    batch, num_blocks = decode_batch([0, 5, 37, 300, 1000], 2, torch.Generator().manual_seed(1), "cuda")
    x = rand(batch.seq_lens.shape[0], 256, dtype=dtype)
    cache = rand(2, num_blocks, PAGE, hkv, d, dtype=dtype)
    if splits is not None:
        monkeypatch.setattr(triton_paged, "num_splits_for", lambda *a: splits)
    targets = [
        (triton_paged, "store_kv"),
        (triton_paged, "fused_decode"),
        (attention_module, "fused_sigmoid_gate"),
    ]
    calls = count_calls(monkeypatch, targets)

    def step():
        with forward_context(ForwardContext(batch, triton_paged.TritonAttention(), None)):
            return layer(batch.positions, x)

    monkeypatch.setattr(triton_paged, "FUSED_DECODE", False)
    with torch.no_grad():
        layer.kv_cache = want_cache = cache.clone()
        want = step()
        assert calls == ["store_kv"] + (["fused_sigmoid_gate"] if layer.output_gate else []), calls
        calls.clear()
        monkeypatch.setattr(triton_paged, "FUSED_DECODE", True)
        layer.kv_cache = got_cache = cache.clone()
        got = step()
        if graph:  # captured after the eager step (which compiled the kernels), replayed on a fresh cache
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = step()
            got_cache.copy_(cache)
            g.replay()
        torch.cuda.synchronize()
    assert calls == ["fused_decode"] * (2 if graph else 1), calls
    assert torch.equal(got_cache, want_cache), "the fused step wrote a different KV cache"
    assert got.dtype == want.dtype and torch.equal(got, want), (got - want).abs().max()


def tiny_stack(dtype):
    """A Qwen3-Next-shaped DecoderModel (GDN, attention, GDN, attention) with dense MLPs."""
    from ft.distributed import TPInfo, tp_context
    from ft.models.config_json import config_from_dict
    from ft.models.decoder import DecoderLayer, DecoderModel
    from ft.models.qwen3_moe import attention
    from ft.models.qwen3_next import Qwen3NextGatedDeltaNet
    from ft.moe.block import GatedMLP
    from tests.checkpoints import QWEN3_NEXT_BASE

    cfg = config_from_dict(QWEN3_NEXT_BASE | dict(model_type="qwen3_next"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with tp_context(TPInfo(0, 1)), torch.device("cuda"):
            layers = [
                DecoderLayer(
                    cfg,
                    kind,
                    Qwen3NextGatedDeltaNet(cfg) if kind == "linear_attention" else attention(cfg),
                    GatedMLP(cfg.hidden_size, 32),
                )
                for kind in cfg.layer_types
            ]
            model = DecoderModel(cfg, layers).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.rand(p.shape) * 2 - 1)
            elif p.dim() < 2:
                p.copy_(
                    torch.randn(p.shape) * 0.2 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
                )
            else:
                p.copy_(torch.randn(p.shape) * 1.2 * p.shape[-1] ** -0.5)
    return cfg, model


def batch_of(chunks: list[tuple[int, int]], page: int) -> ForwardBatch:
    """Sequence i with (context, new tokens) = chunks[i] on pages [16·i, 16·i + 16) of the cache."""
    positions, slots, cu = [], [], [0]
    for i, (ctx, n) in enumerate(chunks):
        positions += range(ctx, ctx + n)
        slots += [(16 * i + p // page) * page + p % page for p in range(ctx, ctx + n)]
        cu.append(cu[-1] + n)

    def cuda(x, dtype=torch.int32):
        return torch.tensor(x, dtype=dtype, device="cuda")

    return ForwardBatch(
        positions=cuda(positions, torch.int64),
        cu_seqlens=cuda(cu),
        context_lens=cuda([c for c, _ in chunks]),
        seq_lens=cuda([c + n for c, n in chunks]),
        block_tables=cuda([list(range(16 * i, 16 * i + 16)) for i in range(len(chunks))]),
        slot_mapping=cuda(slots, torch.int64),
        state_slots=cuda(list(range(len(chunks))), torch.int64),
        prev_token_ids=torch.full((len(chunks), 0), -1, dtype=torch.int64, device="cuda"),  # unused
        block_size=page,
        query_lens_cpu=[n for _, n in chunks],
        context_lens_cpu=[c for c, _ in chunks],
    )


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_stack(torch_path, dtype):
    from ft.attention.torch_ref import TorchAttention
    from ft.forward_context import ForwardContext, forward_context
    from ft.gdn.torch_ref import TorchGDN

    torch.manual_seed(0)
    cfg, model = tiny_stack(dtype)
    steps = [[(0, 7), (0, 300)], [(7, 1), (300, 1)], [(8, 5), (301, 1)]]  # prefill, decode, mixed
    ids = [torch.randint(0, cfg.vocab_size, (sum(q for _, q in s),), device="cuda") for s in steps]

    def run():
        for layer in model.layers:
            mixer = getattr(layer, layer.mixer_name)
            if layer.mixer_name == "self_attn":
                shape = (2, 32, 32, mixer.num_kv_heads, mixer.head_dim)  # 16 pages of 32 per sequence
                mixer.kv_cache = torch.zeros(shape, dtype=dtype, device="cuda")
            else:
                (c, kc), ssm = mixer.state_shapes()
                mixer.conv_state = torch.zeros(2, c, kc, dtype=dtype, device="cuda")
                mixer.ssm_state = torch.zeros(2, *ssm, device="cuda")
        outs = []
        for spec, step_ids in zip(steps, ids):
            batch = batch_of(spec, 32)
            with torch.no_grad(), forward_context(ForwardContext(batch, TorchAttention(), TorchGDN())):
                outs.append(model(step_ids, batch.positions))
        return torch.cat(outs)

    got = run()
    with torch_path():
        want = run()
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-4), rel


@gpu
def test_fused_attention_decode_changes_no_token(tmp_path, monkeypatch):
    """A tiny Qwen3-Next (gated attention heads of 16, rotary on a quarter) generates the same
    tokens and log-probs in bf16 with ``FUSED_DECODE`` as without, graphed and eager."""
    pytest.importorskip("triton")
    from ft import LLM, SamplingParams
    from ft.attention import triton_paged
    from tests.checkpoints import write_checkpoint

    write_checkpoint(tmp_path, "qwen3_next", seed=4)
    prompts = [[5, 17, 3, 88, 41, 9, 2, 60, 33, 71, 12, 50, 7], [30, 1, 64, 19], list(range(1, 40))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    calls = count_calls(monkeypatch, [(triton_paged, "fused_decode")])
    for options in ({}, {"disable_cuda_graph": True}):
        runs = []
        for fused in (False, True):
            monkeypatch.setattr(triton_paged, "FUSED_DECODE", fused)
            calls.clear()
            # a KV pool of its own size, not 90% of what the GPU has free: the kernel tests run in
            # parallel (run_gpu_tests.sh), and a pool sized from free memory starves the others. The
            # backend named: "auto" weighs the model against the free memory, which the other workers
            # can take down so far that it offloads (a MemoryError on 2026-12-05)
            kw = dict(progress=False, device="cuda", dtype="bfloat16", num_tokens=2048, moe_backend="gpu")
            with LLM(model=str(tmp_path), **kw, **options) as llm:
                runs.append(llm.generate(prompts, params))
            assert bool(calls) == fused, (options, fused, len(calls))
        for a, b in zip(*runs):
            assert a.token_ids == b.token_ids, options
            assert a.logprobs == b.logprobs, options
