"""qwen4_exp pieces on their own: QSA block selection and the QSA layer against dense attention,
PLE row ids across chunk boundaries against the oracle's hash, the plain-residual variant, and
config errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from ft.attention.torch_ref import TorchAttention
from ft.distributed import TPInfo, tp_context
from ft.engine.build import build_model
from ft.forward_context import ForwardBatch, ForwardContext, forward_context
from ft.layers.attention import QKNormAttention
from ft.models.config_json import config_from_dict, load_model_config
from ft.models.qwen4_exp.ple import PLETable
from ft.models.qwen4_exp.qsa import QSAAttention, select_blocks
from tests.qwen4_exp.conftest import PROMPTS, generate, greedy, prompt_gaps
from tests.reference.qwen4_exp_ckpt import (
    default_ple_primes,
    tiny_qwen4_exp_config,
    write_qwen4_exp_checkpoint,
)
from tests.reference.qwen4_exp_parts import ple_rows
from tests.reference.qwen4_exp_ref import load_checkpoint, reference_logits


def model_config(**overrides):
    raw = tiny_qwen4_exp_config(**overrides)
    return config_from_dict(raw | {"ple_table_rows": int(default_ple_primes(raw).sum())})


def batch_of(
    chunks: list[tuple[int, int]], page: int, history: list[list[int]] | None = None
) -> ForwardBatch:
    """Sequences i with (context, new tokens) = chunks[i], each in its own run of KV pages."""
    positions, slots, tables, cu = [], [], [], [0]
    next_page = 0
    for ctx, n in chunks:
        pages = list(range(next_page, next_page + -(-(ctx + n) // page)))
        next_page += len(pages)
        positions += range(ctx, ctx + n)
        slots += [pages[p // page] * page + p % page for p in range(ctx, ctx + n)]
        tables.append(pages)
        cu.append(cu[-1] + n)
    width = max(len(t) for t in tables)
    hist = history or [[]] * len(chunks)
    return ForwardBatch(
        positions=torch.tensor(positions),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in chunks], dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in chunks], dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        state_slots=torch.arange(len(chunks)),
        prev_token_ids=torch.tensor([[-1] * (8 - len(h)) + h for h in hist]),
        block_size=page,
        query_lens_cpu=[n for _, n in chunks],
        context_lens_cpu=[c for c, _ in chunks],
    )


def test_selection_rules_and_ties():
    scores = torch.tensor([[9.0, 1.0, 3.0, 3.0, 0.5, 3.0, 7.0, 7.0]])

    def chosen(c, local, topk, num_blocks=8):
        mask = select_blocks(scores[:, :num_blocks], torch.tensor([c]), num_blocks, local, topk)
        return torch.nonzero(mask[0]).flatten().tolist()

    # c = 7: block 0 and the window 6, 7 always; of 1..5 the two best are 2 and 3 (tie with 5)
    assert chosen(7, local=2, topk=2) == [0, 2, 3, 6, 7]
    assert chosen(7, local=1, topk=1) == [0, 6, 7]  # block 0 scores best but is already in
    assert chosen(1, local=2, topk=2, num_blocks=2) == [0, 1]
    assert chosen(4, local=2, topk=9, num_blocks=5) == [0, 1, 2, 3, 4]


@torch.no_grad()
def test_qsa_layer_equals_dense_attention_when_selection_covers_all_blocks():
    page, chunks = 4, [(0, 23), (0, 17)]
    gen = torch.Generator().manual_seed(0)
    with tp_context(TPInfo(0, 1)):
        cfg = model_config(qsa_topk_blocks=100)
        qsa, dense = QSAAttention(cfg), QKNormAttention(64, 4, 2, 16, 8, 10000.0, 1e-6, True, True)
    for p in qsa.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.2))
    dense.load_state_dict({k: v for k, v in qsa.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(40, 64, generator=gen)
    batch = batch_of(chunks, page)

    def run(layer, topk=None):
        layer.kv_cache = torch.zeros(2, 16, page, 2, 16)
        layer.index_keys = torch.zeros(16, page, 8)
        if topk is not None:
            layer.topk = topk
        with forward_context(ForwardContext(batch, TorchAttention(), None)):
            return layer(batch.positions, x)

    expected = run(dense)
    torch.testing.assert_close(run(qsa), expected, atol=1e-6, rtol=1e-5)
    sparse = run(qsa, topk=1)  # 1 + Lc + K = 4 blocks: queries from block 4 on skip some
    torch.testing.assert_close(sparse[:16], expected[:16], atol=1e-6, rtol=1e-5)
    assert (sparse[16:23] - expected[16:23]).abs().amax(-1).min() > 1e-4


@pytest.mark.parametrize("pad_id", [0, 77])  # 77: not 0, so "before the request" must read ple_pad_id
def test_ple_rows_match_the_oracle_across_chunks(pad_id):
    cfg = model_config(ple_pad_id=pad_id)
    tokens = PROMPTS[0][:12]
    with tp_context(TPInfo(0, 1)):
        table = PLETable(cfg)
    table.primes.copy_(torch.tensor([[[1_000_003, 999_983], [524_287, 131_071]], [[65_537, 8191], [127, 7]]]))
    table.multipliers.copy_(torch.randint(-(2**63), 2**63 - 1, table.multipliers.shape))
    expected = ple_rows(tokens, table.multipliers, table.primes, [2, 3], pad_id=pad_id)  # [U, T, O, heads]
    for cut in (1, 2, 5):  # the second chunk starts inside an n-gram that began in the first
        ids = torch.tensor(tokens)
        batch = batch_of([(0, cut), (cut, 12 - cut)], page=4, history=[[], tokens[max(0, cut - 8) : cut]])
        got = table.row_ids(ids, batch)  # [T, U, O, heads]
        assert torch.equal(got.transpose(0, 1), expected), f"cut at {cut}"


def test_single_stream_without_ple_matches_the_oracle(tmp_path):
    config = tiny_qwen4_exp_config(hc_mult=1, ple_layers=[], tie_word_embeddings=True)
    write_qwen4_exp_checkpoint(tmp_path, config, seed=5)
    weights, _ = load_checkpoint(tmp_path)
    out = generate(tmp_path, PROMPTS[:1], greedy(4, prompt_logprobs=0))[0]
    ref = torch.log_softmax(reference_logits(weights, config, PROMPTS[0] + out.token_ids), dim=-1)
    assert prompt_gaps(out, ref).max() < 1e-4
    assert out.token_ids == ref[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),  # Hv % Hk != 0
        (
            dict(layer_types=["linear_attention", "sliding", "linear_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(layer_types=["linear_attention"]), "layer_types"),
        (dict(ple_ngram_orders=[2, 12]), "ple_ngram_orders"),
        (dict(ple_layers=[0, 7]), "ple_layers"),
        (dict(ple_layers=[2, 2]), "ple_layers"),  # one layer, two values of u
        (dict(qsa_block_size=0), "qsa_block_size"),
    ],
)
def test_bad_fields_are_named(tmp_path, change, field):
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen4_exp_config(**change)))
    with pytest.raises(ValueError, match=field):
        load_model_config(str(tmp_path))


def test_unshardable_intermediate_size_is_named_at_build():
    cfg = model_config(moe_intermediate_size=30, linear_num_key_heads=4, linear_num_value_heads=8)
    build_model(cfg, TPInfo(0, 2), "meta", torch.float32)  # 15 rows per rank: fine
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        build_model(cfg, TPInfo(0, 4), "meta", torch.float32)


def test_max_keys_is_what_the_selection_lets_a_query_read():
    """Block 0, Lc local blocks and K selected ones: (1 + Lc + K)·B keys at most (the roofline's cap)."""
    with tp_context(TPInfo(0, 1)):
        qsa = QSAAttention(model_config(qsa_block_size=4, qsa_local_blocks=2, qsa_topk_blocks=3))
    length, blocks = 64, 16
    positions = torch.arange(length)
    scores = torch.randn(length, blocks, generator=torch.Generator().manual_seed(0))
    mask = select_blocks(scores, positions // 4, blocks, local=2, topk=3)
    keys = (mask.repeat_interleave(4, dim=1) & (torch.arange(length)[None] <= positions[:, None])).sum(1)
    assert int(keys.max()) == qsa.max_keys == (1 + 2 + 3) * 4


def test_ple_layers_in_any_order_match_the_oracle(tmp_path):
    """``u`` is a layer's index in ``ple_layers`` (spec section 7), which need not be sorted."""
    config = tiny_qwen4_exp_config(ple_layers=[3, 0])
    write_qwen4_exp_checkpoint(tmp_path, config, seed=6)
    weights, _ = load_checkpoint(tmp_path)
    out = generate(tmp_path, PROMPTS[:1], greedy(1, prompt_logprobs=0))[0]
    ref = torch.log_softmax(reference_logits(weights, config, PROMPTS[0] + out.token_ids), dim=-1)
    assert prompt_gaps(out, ref).max() < 1e-4


def test_the_decode_roofline_counts_what_a_qsa_query_reads():
    """Past ``max_keys`` cached tokens a QSA layer's decode reads ``max_keys`` keys and values and
    one mean indexer key a complete block, not the whole context (a dense layer would)."""
    from ft.bench.roofline import decode_step_bytes

    mc = config_from_dict(tiny_qwen4_exp_config() | {"ple_table_rows": 546})
    model = build_model(mc, TPInfo(0, 1), "meta", torch.bfloat16)
    qsa = [m for m in model.modules() if isinstance(m, QSAAttention)]
    assert qsa
    h, d = qsa[0].cache_shape()
    context = 50 * qsa[0].max_keys
    per_layer = 2 * h * d * qsa[0].max_keys + context // qsa[0].block_size * qsa[0].indexer.head_dim
    assert decode_step_bytes(model, mc, 3, context).kv == 3 * 2 * len(qsa) * per_layer
    short = qsa[0].block_size - 1  # no complete block yet: every key, no block summary
    assert decode_step_bytes(model, mc, 1, short).kv == 2 * len(qsa) * 2 * h * d * short
