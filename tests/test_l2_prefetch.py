"""The L2 prefetch plan (``ft.layers.l2_prefetch``): which weight each pre-norm asks for, and the
kernel arguments a norm launch gets. Its effect is time only (GPU: tests/gpu/l2_prefetch_timings.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ft.distributed import TPInfo  # noqa: E402
from ft.engine.build import build_model  # noqa: E402
from ft.layers import l2_prefetch  # noqa: E402
from ft.models.config_json import load_model_config  # noqa: E402
from tests.checkpoints import write_checkpoint  # noqa: E402


def _same(view: torch.Tensor, w: torch.Tensor) -> bool:
    return view.dtype == torch.uint8 and view.data_ptr() == w.data_ptr() and view.numel() == w.nbytes


def test_norms_prefetch_the_next_projection(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next", seed=0)
    mc = load_model_config(str(tmp_path))
    layers = build_model(mc, TPInfo(0, 1), "cpu", torch.bfloat16).model.layers
    assert {layer.mixer_name for layer in layers} == {"self_attn", "linear_attn"}  # both kinds checked
    l2_prefetch.plan(layers)
    for i, layer in enumerate(layers):
        mixer = getattr(layer, layer.mixer_name)
        out = mixer.o_proj if layer.mixer_name == "self_attn" else mixer.out_proj
        assert _same(layer.input_layernorm.l2_prefetch, out.weight), f"layer {i}: not its output projection"
        target = layer.post_attention_layernorm.l2_prefetch
        if i + 1 == len(layers):
            assert target is None
            continue
        following = layers[i + 1]
        nxt = getattr(following, following.mixer_name)
        first = nxt.qkv_proj if following.mixer_name == "self_attn" else nxt.in_proj
        assert _same(target, first.weight), f"layer {i}: not layer {i + 1}'s input projection"


def test_kernel_args(monkeypatch):
    target = torch.zeros(3 << 20, dtype=torch.uint8)
    monkeypatch.setattr(l2_prefetch, "MB", 0)
    assert l2_prefetch.kernel_args(target, 1)["PF_CHUNKS"] == 0  # off
    monkeypatch.setattr(l2_prefetch, "MB", 2)
    args = l2_prefetch.kernel_args(target, 4)
    assert args["pf"] is target and args["pf_bytes"] == 2 << 20  # the first MB megabytes
    assert args["PF_CHUNKS"] * l2_prefetch.CHUNK_BYTES >= 2 << 20  # every byte asked for
    assert args["PF_CHUNKS"] & (args["PF_CHUNKS"] - 1) == 0  # a power of two (an arange)
    monkeypatch.setattr(l2_prefetch, "MB", 64)
    assert l2_prefetch.kernel_args(target, 1)["pf_bytes"] == 3 << 20  # no more than the weight
    assert l2_prefetch.kernel_args(target, l2_prefetch.MAX_ROWS + 1)["PF_CHUNKS"] == 0  # prefill
    assert l2_prefetch.kernel_args(None, 1)["PF_CHUNKS"] == 0
    assert l2_prefetch.kernel_args(target[:1000], 1)["pf_bytes"] == 992  # whole 16-byte units
    assert l2_prefetch.kernel_args(target[:15], 1)["PF_CHUNKS"] == 0
    assert l2_prefetch.kernel_args(target[8:], 1)["PF_CHUNKS"] == 0  # unaligned: the instruction faults
