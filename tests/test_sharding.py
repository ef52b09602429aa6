"""Every sharded tensor's per-rank slices reassemble to the checkpoint's original tensor.

The reassembly rules below are written from the layouts (not from the loader's code): q rows per
head with their gate, kv heads split or replicated, GDN groups per key head, conv channels by
part, experts and the shared expert along the intermediate axis, vocab rows; the router and the
shared expert's gate replicated, as rows of one router weight with the gate last.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.config_json import load_model_config
from ft.models.loader import load_weights
from tests.checkpoints import write_checkpoint


def rank_states(path, tp: int) -> list[dict[str, torch.Tensor]]:
    mc = load_model_config(str(path))
    states = []
    for r in range(tp):
        model = build_model(mc, TPInfo(r, tp), "cpu", torch.float32)
        load_weights(model, str(path), progress=False)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def cat(states, name, dim=0, rows=None):
    parts = [s[name] if rows is None else s[name][rows] for s in states]
    return torch.cat(parts, dim=dim)


def kv_heads(states, name, first, size, num_kv, head_dim):
    """k or v rows: split when num_kv >= P, else each head lives on P/num_kv consecutive ranks."""
    tp = len(states)
    owners = range(tp) if num_kv >= tp else [h * tp // num_kv for h in range(num_kv)]
    return torch.cat([states[r][name][first : first + size] for r in owners], dim=0)


def router_part(states, name: str, num_experts: int) -> torch.Tensor | None:
    """``mlp.gate`` or ``mlp.shared_expert_gate``: its rows of the replicated router weight."""
    m = re.match(r"(.*\.mlp)\.(gate|shared_expert_gate)\.weight$", name)
    if m is None:
        return None
    fused = f"{m.group(1)}.gate.weight"  # [E, H], or [E + 1, H] with the shared gate last
    for s in states[1:]:
        assert torch.equal(s[fused], states[0][fused]), fused
    return states[0][fused][:num_experts] if m.group(2) == "gate" else states[0][fused][num_experts:]


def reassemble(states, name: str, mc) -> torch.Tensor:
    tp = len(states)
    if (router := router_part(states, name, mc.num_experts)) is not None:
        return router
    hd, hq, hkv = mc.head_dim, mc.num_heads, mc.num_kv_heads
    m = re.match(r"(.*)\.self_attn\.([qkv])_proj\.weight$", name)
    if m:
        fused = f"{m.group(1)}.self_attn.qkv_proj.weight"
        q_rows = hq // tp * hd * (2 if mc.attn_output_gate else 1)
        kv_rows = max(1, hkv // tp) * hd
        if m.group(2) == "q":
            return cat(states, fused, rows=slice(0, q_rows))
        first = q_rows + (0 if m.group(2) == "k" else kv_rows)
        return kv_heads(states, fused, first, kv_rows, hkv, hd)
    m = re.match(r"(.*)\.(gate|up)_proj\.weight$", name)
    if m and ".experts." not in name:
        fused = f"{m.group(1)}.gate_up_proj.weight"
        half = states[0][fused].shape[0] // 2
        return cat(states, fused, rows=slice(0, half) if m.group(2) == "gate" else slice(half, None))
    m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    if m:
        e, proj = int(m.group(2)), m.group(3)
        if proj == "down":
            return torch.cat([s[f"{m.group(1)}.w2"][e] for s in states], dim=1)
        w13 = [s[f"{m.group(1)}.w13"][e] for s in states]
        half = w13[0].shape[0] // 2
        return torch.cat([w[:half] if proj == "gate" else w[half:] for w in w13], dim=0)
    if name.endswith("conv1d.weight"):
        key = mc.linear_key_dim // tp
        val = mc.linear_value_dim // tp
        pieces = [slice(0, key), slice(key, 2 * key), slice(2 * key, 2 * key + val)]
        return torch.cat([cat(states, name, rows=p) for p in pieces], dim=0)
    if re.search(r"(o_proj|out_proj|down_proj)\.weight$", name):
        return cat(states, name, dim=1)
    if re.search(r"(in_proj_qkvz|in_proj_ba)\.weight$", name):
        # on disk: per key head [q k v z] (or [b a]); each rank holds its key heads part-major
        hk, r = mc.linear_num_key_heads // tp, mc.linear_num_value_heads // mc.linear_num_key_heads
        dk, dv = mc.linear_key_head_dim, mc.linear_value_head_dim
        # both load into one fused in_proj: this rank's [q k v z] rows, then its [b a] rows
        fused = re.sub(r"in_proj_(qkvz|ba)\.weight$", "in_proj.weight", name)
        qkvz_rows = hk * (2 * dk + 2 * r * dv)
        widths = [dk, dk, r * dv, r * dv] if "qkvz" in name else [r, r]
        grouped = []
        for s in states:
            mine = s[fused][:qkvz_rows] if "qkvz" in name else s[fused][qkvz_rows:]
            parts = [p.view(hk, w, -1) for p, w in zip(mine.split([hk * w for w in widths]), widths)]
            grouped.append(torch.cat(parts, dim=1).reshape(-1, mine.shape[1]))
        return torch.cat(grouped)
    if re.search(r"A_log$|dt_bias$", name):
        return cat(states, name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return cat(states, name)[: mc.vocab_size]
    for s in states[1:]:  # replicated: identical everywhere
        assert torch.equal(s[name], states[0][name]), name
    return states[0][name]


@pytest.mark.parametrize(
    "model_type,tp,overrides",
    [
        ("qwen3_next", 2, dict(num_key_value_heads=2, vocab_size=95)),
        # two key heads per rank: the part-major reorder within a rank shows
        ("qwen3_next", 2, dict(linear_num_key_heads=4, linear_num_value_heads=12)),
        ("qwen3_next", 4, dict(linear_num_key_heads=4, linear_num_value_heads=12, num_key_value_heads=2)),
        ("qwen3_moe", 4, dict(num_key_value_heads=1, mlp_only_layers=[1])),
    ],
)
def test_slices_reassemble(tmp_path, model_type, tp, overrides):
    write_checkpoint(tmp_path, model_type, **overrides)
    mc = load_model_config(str(tmp_path))
    original = load_file(str(tmp_path / "model.safetensors"))
    states = rank_states(tmp_path, tp)
    assert states[0]["model.layers.0.mlp.gate.weight"].shape[0] > 0
    for name, tensor in original.items():
        assert torch.equal(reassemble(states, name, mc), tensor), name
    # a shard really is a shard: rank 0 holds less than the whole expert bank
    w13 = states[0]["model.layers.0.mlp.experts.w13"] if mc.mlp_types[0] == "moe" else None
    if w13 is not None:
        assert w13.shape[1] == 2 * mc.moe_intermediate_size // tp


HEADS_16 = dict(num_attention_heads=16, num_key_value_heads=16)  # so that the MLP is what cannot split


@pytest.mark.parametrize(
    "model_type,overrides,field",
    [
        ("qwen3_moe", dict(mlp_only_layers=[0], intermediate_size=40), "intermediate_size"),
        (
            "qwen3_next",
            dict(shared_expert_intermediate_size=40, layer_types=["full_attention"] * 4),
            "shared_expert_intermediate_size",
        ),
    ],
)
def test_tp_that_cannot_split_an_mlp_names_its_size(tmp_path, model_type, overrides, field):
    from ft.models.config_json import load_model_config
    from tests.checkpoints import make_hf_model

    # through config.json as a checkpoint has it (transformers' to_dict() names the experts
    # num_local_experts, which config_from_dict alone reads as a model without any)
    make_hf_model(model_type, **HEADS_16, **overrides).config.save_pretrained(tmp_path)
    mc = load_model_config(str(tmp_path))
    assert "moe" in mc.mlp_types  # the experts split: the dense or shared MLP is what cannot
    with pytest.raises(ValueError, match=rf"^{field} over tp ranks: 40 is not divisible by 16"):
        build_model(mc, TPInfo(0, 16), "meta", torch.float32)


def test_heads_that_cannot_be_replicated_evenly_say_so():
    """Fewer heads than ranks: each head lives on P / heads ranks, so P must be a multiple of the
    heads; 2 heads over 3 ranks is refused in those words (it read "3 is not divisible by 2")."""
    from ft.layers.linear import heads_part

    assert heads_part(2, 4, TPInfo(3, 4), "kv heads") == heads_part(2, 4, TPInfo(2, 4), "kv heads")
    with pytest.raises(ValueError, match=r"^kv heads: 2 heads cannot be replicated evenly over 3 "):
        heads_part(2, 4, TPInfo(0, 3), "kv heads")
