"""The fused decode step of QK-normed attention (``ft.attention.triton_paged.FUSED_DECODE``) run by
Triton's interpreter on CPU tensors: the same cache contents and gated output as the unfused
kernels, bit for bit, and the torch reference's within fp32 error.

Fused: ``qk_norm_rope_store`` (norms, rope and the k/v cache write in one kernel), then the decode
kernels with the output gate applied where they write. Unfused: ``qk_norm_rope``, ``store_kv``,
the decode kernels, ``sigmoid_gate``. Cases: Qwen3-Next's heads (256 wide, 16 q / 2 kv, gated,
rotary on a quarter of each head), Qwen3-30B's (128 wide, 32 / 4, no gate), one split and four,
a padding row (slot -1) beside real ones, and the rope kernel's eight-heads-a-program layout.

Skipped without triton (CI has it); ``tests/gpu/test_fused_layers.py`` checks the
compiled kernels in bf16, eager and in a CUDA graph. The interpreter is chosen when a kernel is
decorated, so each check runs in a process of its own with ``TRITON_INTERPRET=1`` (``run_check``).
It truncates fp32 -> bf16 where the GPU rounds to nearest, so exact rounding is checked in fp16
and fp32 only.
"""

from __future__ import annotations

import pytest
import torch

from ft.forward_context import ForwardBatch
from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER
PAGE = 16
# (head_dim, rotary_dim, Hq, Hkv, output_gate, zero_centred)
QWEN3_NEXT = (256, 64, 16, 2, True, True)
QWEN3_30B = (128, 128, 32, 4, False, False)


def decode_batch(
    contexts: list[int], padding: int, gen: torch.Generator, device: str = "cpu"
) -> tuple[ForwardBatch, int]:
    """A decode step of len(contexts) sequences over shuffled pages, then ``padding`` rows as a
    captured graph pads them (token at position 0, slot -1, block 0, seq_len 1)."""
    need = [c // PAGE + 1 for c in contexts]
    num_blocks = sum(need) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for c, n in zip(contexts, need):
        blocks = [free.pop() for _ in range(n)]
        tables.append(blocks + [0] * (max(need) - n))
        slots.append(blocks[c // PAGE] * PAGE + c % PAGE)
    tables += [[0] * max(need)] * padding
    b = len(contexts) + padding
    lens = [c + 1 for c in contexts] + [1] * padding

    def tensor(x, dtype=torch.int32):
        return torch.tensor(x, dtype=dtype, device=device)

    batch = ForwardBatch(
        positions=tensor(contexts + [0] * padding, torch.int64),
        cu_seqlens=tensor(list(range(b + 1))),
        context_lens=tensor(contexts + [0] * padding),
        seq_lens=tensor(lens),
        block_tables=tensor(tables),
        slot_mapping=tensor(slots + [-1] * padding, torch.int64),
        state_slots=tensor([0] * b, torch.int64),
        prev_token_ids=torch.full((b, 0), -1, dtype=torch.int64, device=device),  # unused
        block_size=PAGE,
        query_lens_cpu=[1] * b,
        context_lens_cpu=contexts + [0] * padding,
    )
    return batch, num_blocks


def layer_parts(shape, dtype: torch.dtype, b: int, gen: torch.Generator):
    """The rotary and norms of one layer, and a [B, ...] projection output split into raw q, k, v
    views and the gate view (None without an output gate), as ``QKNormAttention.forward`` splits."""
    from ft.layers.norm import RMSNorm
    from ft.layers.rotary import RotaryEmbedding

    d, rot, hq, hkv, output_gate, zc = shape
    rope = RotaryEmbedding(d, rot, 1e7)
    norms = [RMSNorm(d, 1e-6, zc) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.randn(d, generator=gen) * 0.2 + (0.0 if zc else 1.0)).to(dtype)
    q_rows = 2 * d if output_gate else d
    proj = (torch.randn(b, hq * q_rows + 2 * hkv * d, generator=gen) * 2).to(dtype)
    q, k, v = proj.split([hq * q_rows, hkv * d, hkv * d], dim=-1)
    heads = q.view(b, hq, q_rows)
    gate = heads[..., d:] if output_gate else None
    return rope, norms, heads[..., :d], k.view(b, hkv, d), v.view(b, hkv, d), gate


def unfused_decode(q, k, v, cache, batch, scale, rope, norms, gate, splits):
    """The decode step as four (with a gate: five) separate launches."""
    from ft.attention import triton_paged
    from ft.layers import triton_rope

    qn, kn = norms
    args = (batch.positions, q, k, qn.weight, kn.weight, rope.inv_freq, qn.eps, qn.zero_centered)
    q, k = triton_rope.qk_norm_rope(*args)
    triton_paged.store_kv(cache, k, v, batch.slot_mapping)
    out = triton_paged.paged_decode(q, cache, batch.block_tables, batch.seq_lens, scale, splits)
    return out if gate is None else triton_rope.sigmoid_gate(out, gate)


def check_fused_decode(shape, dtypes=(torch.float16, torch.float32)) -> None:
    from ft.attention import triton_paged
    from ft.attention.torch_ref import TorchAttention
    from ft.layers import triton_rope
    from ft.layers.attention import QKNormGate

    gen = torch.Generator().manual_seed(shape[0])
    d, _, hq, hkv, _, _ = shape
    for dtype in dtypes:
        batch, num_blocks = decode_batch([0, 5, 37, 100], padding=1, gen=gen)
        b, scale = batch.seq_lens.shape[0], d**-0.5
        rope, norms, q, k, v, gate = layer_parts(shape, dtype, b, gen)
        around = QKNormGate(batch.positions, rope, *norms, gate)
        cache = torch.randn(2, num_blocks, PAGE, hkv, d, generator=gen).to(dtype)
        # one split and four, a head a program (decode-sized) and eight (as the prefill layout
        # groups them): each pairing once over the two dtypes (the interpreter's time)
        for splits, heads_a_program in ((1, 1), (4, 8)) if dtype == dtypes[0] else ((1, 8), (4, 1)):
            triton_rope.PREFILL_TOKENS = 10**9 if heads_a_program == 1 else 1
            want_cache, got_cache = cache.clone(), cache.clone()
            want = unfused_decode(q, k, v, want_cache, batch, scale, rope, norms, gate, splits)
            got = triton_paged.fused_decode(q, k, v, got_cache, batch, scale, around, splits)
            case = (dtype, splits, heads_a_program)
            assert got.shape == (b, hq, d) and got.dtype == dtype, case
            assert torch.equal(got_cache, want_cache), case
            assert torch.equal(got, want), case
        triton_rope.PREFILL_TOKENS = 64
        # the new tokens' rows changed and nothing else did: padding (slot -1) wrote nothing
        slots = batch.slot_mapping[batch.slot_mapping >= 0]
        flat_got, flat_before = got_cache.view(2, -1, hkv, d), cache.view(2, -1, hkv, d)
        changed = (flat_got != flat_before).flatten(2).any(-1).any(0).nonzero().flatten()
        assert changed.tolist() == sorted(slots.tolist()), (changed, slots)
        if dtype == torch.float32:  # the torch reference composes the same steps: to fp32 error
            ref_cache = cache.clone()
            ref = TorchAttention().forward(q, k, v, ref_cache, batch, scale, around)
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(got_cache, ref_cache, atol=2e-5, rtol=2e-5)


def check_qwen3_next() -> None:
    check_fused_decode(QWEN3_NEXT)


def check_qwen3_30b() -> None:
    check_fused_decode(QWEN3_30B)


def check_many_splits() -> None:
    """More KV splits than the combine loads at once (``COMBINE_CHUNK``): a sequence whose keys
    fill three chunks of splits, one that fills a few splits of the first, padding rows of one key
    and of none, with and without the gate; each against one split and the torch reference."""
    from ft.attention import triton_paged
    from ft.attention.torch_ref import causal_attention, gather_kv
    from ft.layers.triton_rope import sigmoid_gate

    gen = torch.Generator().manual_seed(3)
    d, hq, hkv, dtype = 256, 4, 2, torch.float32  # 256-wide heads: 32-key tiles, the most splits
    contexts = [2999, 40, 7]
    batch, num_blocks = decode_batch(contexts, padding=2, gen=gen)  # padding rows see one key
    batch.seq_lens[-1] = 0  # and a row with no keys at all
    b, scale = len(contexts) + 2, d**-0.5
    cache = torch.randn(2, num_blocks, PAGE, hkv, d, generator=gen).to(dtype)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    gate = torch.randn(b, hq, d, generator=gen).to(dtype)
    tables, lens = batch.block_tables, batch.seq_lens
    one = triton_paged.paged_decode(q, cache, tables, lens, scale, 1)
    for splits in (128, 32):
        for g in (None, gate):
            got = triton_paged.paged_decode(q, cache, tables, lens, scale, splits, g)
            want = one if g is None else sigmoid_gate(one, g)
            case = f"{splits} splits, gate {g is not None}"
            torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5, msg=case)
    assert torch.equal(one[-1], torch.zeros_like(one[-1])), "a row without keys gives zeros"
    for i, c in enumerate(contexts + [0]):  # the new token at position c sees keys 0 .. c (padding: 0)
        keys, values = gather_kv(cache, tables[i], c + 1)
        ref = causal_attention(q[i : i + 1], keys, values, c, scale)[0]
        torch.testing.assert_close(one[i], ref, atol=2e-5, rtol=2e-5)


CHECKS = ["check_qwen3_next", "check_qwen3_30b", "check_many_splits"]


@pytest.mark.parametrize("check", CHECKS)
def test_fused_decode_under_the_interpreter(check):
    run_check("tests.test_attention_fusions_interp", check)


def test_the_split_count_is_a_power_of_two_under_any_cap(monkeypatch):
    """``FT_ATTN_MAX_SPLITS`` rounds down to a power of two (the kernels assert one): a batch-1
    decode of 2 kv heads on 132 SMs over a wide table asks for 256 splits."""
    from ft.attention import triton_paged

    monkeypatch.setattr(triton_paged, "_num_sms", lambda index: 132)
    q, cache = torch.empty(1, 16, 256), torch.empty(2, 1, 16, 2, 256)
    table = torch.empty(1, 16384, dtype=torch.int32)  # 262,144 tokens of 16-token pages
    got = {}
    for cap in (1, 32, 48, 128, 1000):
        monkeypatch.setattr(triton_paged, "MAX_SPLITS", cap)
        got[cap] = triton_paged.num_splits_for(q, cache, table, 32)
    assert got == {1: 1, 32: 32, 48: 32, 128: 128, 1000: 256}
