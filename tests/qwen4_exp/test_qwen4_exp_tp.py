"""qwen4_exp under tensor parallelism on CPU (gloo): TP=2 and TP=4 (kv heads replicated) equal
TP=1, and every sharded tensor's per-rank slices reassemble to the checkpoint's tensor.

The reassembly rules are written from spec section 9, not from the layers' code: qkv_proj by
query head with each head's [q_h, gate_h] rows together, then k and v heads (split, or each kv
head on P/Hkv consecutive ranks); the six in_proj parts each split by heads; conv1d channels by
their q/k/v part; A_log and dt_bias by value head; shared gate_up per part; o_proj, out_proj and
down projections by input column; experts along I; vocab rows; the rest replicated, the router
and the shared expert's gate as rows of one router weight (the gate last)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.qwen4_exp.conftest import PROMPTS, generate, greedy, max_logprob_gap
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint
from tests.test_sharding import cat, kv_heads, rank_states, router_part

# TP=2: 2 kv heads split; TP=4: 2 kv heads each on 2 ranks, GDN 4 key / 8 value heads split by 4
CASES = [(2, {}), (4, dict(linear_num_key_heads=4, linear_num_value_heads=8))]


@pytest.mark.parametrize("tp,overrides", CASES)
def test_tp_equals_tp1(tmp_path, tp, overrides):
    write_qwen4_exp_checkpoint(tmp_path, tiny_qwen4_exp_config(**overrides), seed=tp)
    params = greedy(4, prompt_logprobs=0, logprobs=2)
    one = generate(tmp_path, PROMPTS[:2], params)
    assert max_logprob_gap(generate(tmp_path, PROMPTS[:2], params, tp_size=tp), one) < 1e-5


def reassemble(states, name: str, c: dict) -> torch.Tensor:
    tp = len(states)
    d, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    if (router := router_part(states, name, c["num_experts"])) is not None:
        return router
    if name.endswith("qkv_proj.weight"):
        q_rows, kv_rows = hq // tp * 2 * d, max(1, hkv // tp) * d
        q = cat(states, name, rows=slice(0, q_rows))  # heads in rank order, [q_h, gate_h] each
        k = kv_heads(states, name, q_rows, kv_rows, hkv, d)
        return torch.cat([q, k, kv_heads(states, name, q_rows + kv_rows, kv_rows, hkv, d)])
    if name.endswith("in_proj.weight"):
        local = [hk * dk // tp, hk * dk // tp, hv * dv // tp, hv * dv // tp, hv // tp, hv // tp]
        bounds = torch.tensor([0, *local]).cumsum(0).tolist()
        return torch.cat([cat(states, name, rows=slice(a, b)) for a, b in zip(bounds, bounds[1:])])
    if name.endswith("conv1d.weight"):
        local = [hk * dk // tp, hk * dk // tp, hv * dv // tp]
        bounds = torch.tensor([0, *local]).cumsum(0).tolist()
        return torch.cat([cat(states, name, rows=slice(a, b)) for a, b in zip(bounds, bounds[1:])])
    if name.endswith(("A_log", "dt_bias")):
        return cat(states, name)
    if name.endswith("gate_up_proj.weight"):
        half = states[0][name].shape[0] // 2
        return torch.cat([cat(states, name, rows=slice(0, half)), cat(states, name, rows=slice(half, None))])
    if name.endswith(("o_proj.weight", "out_proj.weight", "shared_expert.down_proj.weight")):
        return cat(states, name, dim=1)
    if ".mlp.experts." in name:
        bank, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
        if proj == "down_proj":
            return torch.cat([s[f"{bank}.w2"][e] for s in states], dim=1)
        w13 = [s[f"{bank}.w13"][e] for s in states]
        half = w13[0].shape[0] // 2
        return torch.cat([w[:half] if proj == "gate_proj" else w[half:] for w in w13])
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return cat(states, name)[: c["vocab_size"]]
    for s in states[1:]:  # router, indexer, norms, hyper-connections, PLE: identical everywhere
        assert torch.equal(s[name], states[0][name]), name
    return states[0][name]


@pytest.mark.parametrize("tp,overrides", CASES)
def test_slices_reassemble(tmp_path, tp, overrides):
    config = tiny_qwen4_exp_config(**overrides)
    write_qwen4_exp_checkpoint(tmp_path, config)
    original = load_file(str(tmp_path / "model.safetensors"))
    states = rank_states(tmp_path, tp)
    for name, tensor in original.items():
        assert torch.equal(reassemble(states, name, config), tensor), name
    # a shard is a shard: rank 0 holds a 1/tp share of the six-part in_proj and fewer q heads
    in_proj = "model.layers.0.linear_attn.in_proj.weight"
    assert states[0][in_proj].shape[0] * tp == original[in_proj].shape[0]
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert states[0][qkv].shape[0] < original[qkv].shape[0]
