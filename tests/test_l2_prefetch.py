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


def _same(target, w: torch.Tensor, next_layer: bool) -> bool:
    view = target.weight
    return (
        target.next_layer == next_layer
        and view.dtype == torch.uint8
        and view.data_ptr() == w.data_ptr()
        and view.numel() == w.nbytes
    )


def test_norms_prefetch_the_next_projection(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next", seed=0)
    mc = load_model_config(str(tmp_path))
    layers = build_model(mc, TPInfo(0, 1), "cpu", torch.bfloat16).model.layers
    assert {layer.mixer_name for layer in layers} == {"self_attn", "linear_attn"}  # both kinds checked
    l2_prefetch.plan(layers)
    for i, layer in enumerate(layers):
        mixer = getattr(layer, layer.mixer_name)
        out = mixer.o_proj if layer.mixer_name == "self_attn" else mixer.out_proj
        assert _same(layer.input_layernorm.l2_prefetch, out.weight, False), (
            f"layer {i}: not its output projection"
        )
        target = layer.post_attention_layernorm.l2_prefetch
        if i + 1 == len(layers):
            assert target is None
            continue
        following = layers[i + 1]
        nxt = getattr(following, following.mixer_name)
        first = nxt.qkv_proj if following.mixer_name == "self_attn" else nxt.in_proj
        assert _same(target, first.weight, True), f"layer {i}: not layer {i + 1}'s input projection"


def test_kernel_args(monkeypatch):
    view = torch.zeros(3 << 20, dtype=torch.uint8)
    nxt, out = l2_prefetch.Target(view, True), l2_prefetch.Target(view, False)
    assert l2_prefetch.kernel_args(nxt, 1, 128)["PF_CHUNKS"] == 0  # no GPU here (takes)
    monkeypatch.setattr(l2_prefetch, "takes", lambda t: True)
    monkeypatch.setattr(l2_prefetch, "MB", 0)
    monkeypatch.setattr(l2_prefetch, "OUT_MB", 0)
    assert l2_prefetch.kernel_args(nxt, 1, 128)["PF_CHUNKS"] == 0  # off
    monkeypatch.setattr(l2_prefetch, "MB", 2)
    args = l2_prefetch.kernel_args(nxt, 4, 128)
    assert args["pf"] is view and args["pf_bytes"] == 2 << 20  # the first MB megabytes
    assert args["PF_CHUNKS"] == 128  # 32 chunks of 64 KB cover them, a thread each at the least
    assert l2_prefetch.kernel_args(out, 1, 128)["PF_CHUNKS"] == 0  # the output projection's own budget
    monkeypatch.setattr(l2_prefetch, "OUT_MB", 1)
    assert l2_prefetch.kernel_args(out, 1, 128)["pf_bytes"] == 1 << 20
    monkeypatch.setattr(l2_prefetch, "MB", 64)
    args = l2_prefetch.kernel_args(nxt, 1, 128)
    assert args["pf_bytes"] == 3 << 20 and args["PF_CHUNKS"] == 128  # no more than the weight
    assert l2_prefetch.kernel_args(nxt, 1, 32)["PF_CHUNKS"] == 64  # 48 chunks, a power of two
    assert l2_prefetch.kernel_args(nxt, l2_prefetch.MAX_ROWS + 1, 128)["PF_CHUNKS"] == 0  # prefill
    assert l2_prefetch.kernel_args(None, 1, 128)["PF_CHUNKS"] == 0
    assert (
        l2_prefetch.kernel_args(l2_prefetch.Target(view[:1000], True), 1, 128)["pf_bytes"] == 992
    )  # 16-byte units
    assert l2_prefetch.kernel_args(l2_prefetch.Target(view[:15], True), 1, 128)["PF_CHUNKS"] == 0
    assert l2_prefetch.kernel_args(l2_prefetch.Target(view[8:], True), 1, 128)["PF_CHUNKS"] == 0  # unaligned


def test_rows_args(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "takes", lambda t: True)
    bank = torch.zeros(4, 2048, 256, dtype=torch.uint8)  # 512 KB an expert
    view, stride, per, chunks = l2_prefetch.rows_args(bank, 128)
    assert view.data_ptr() == bank.data_ptr() and stride == per == 512 << 10 and chunks == 128
    assert l2_prefetch.rows_args(torch.zeros(4, 2048, 256, dtype=torch.bfloat16), 64)[1:] == (
        1 << 20,
        1 << 20,
        64,
    )
    assert l2_prefetch.rows_args(bank[:, :, :100], 128) is None  # an expert not one block
    assert l2_prefetch.rows_args(torch.zeros(4, 3, 5, dtype=torch.uint8), 128) is None  # 15 bytes an expert
