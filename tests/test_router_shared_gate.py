"""The shared expert's gate folded into the router: one GEMM gives the routing and the gate logit.

The fused router equals the two separate products (the expert columns bitwise; the gate column
to fp32 rounding, a GEMM column against a GEMV), a checkpoint's separate ``mlp.gate`` and
``mlp.shared_expert_gate`` load into its one weight, and a checkpoint missing either is refused
by name. The kernels reading strided views of the fused logits run under Triton's interpreter
here and compiled in ``tests/gpu/test_router_fold.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ft.distributed import TPInfo, tp_context
from ft.engine.build import build_model
from ft.models.checkpoint import CheckpointError
from ft.models.config_json import load_model_config
from ft.models.loader import load_weights
from ft.moe.block import SparseMoeBlock
from ft.moe.router import TopKRouter, route
from tests.checkpoints import write_checkpoint
from tests.interpreter import run_check


@pytest.mark.parametrize(
    "t,h,e,k,renormalize", [(1, 48, 8, 2, True), (13, 64, 60, 4, False), (5, 256, 128, 8, True)]
)
def test_fused_router_equals_the_separate_products(t, h, e, k, renormalize):
    torch.manual_seed(t)
    router = TopKRouter(h, e, k, renormalize, shared_gate=True)
    router.weight.normal_(0.0, h**-0.5)
    x = torch.randn(t, h)
    weights, ids, shared_logit = router(x)
    ref_w, ref_ids = route(F.linear(x, router.weight[:e]), k, renormalize)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    assert shared_logit.shape == (t, 1)
    torch.testing.assert_close(shared_logit, F.linear(x, router.weight[e:]), atol=1e-5, rtol=1e-5)


def test_router_without_a_shared_expert_stays_plain():
    router = TopKRouter(16, 8, 2, True)
    assert router.weight.shape == (8, 16)
    router.weight.normal_()
    assert router(torch.randn(3, 16))[2] is None
    with tp_context(TPInfo(0, 1)):
        block = SparseMoeBlock(16, 8, 2, 8, True, shared_intermediate_size=8)
    assert block.gate.weight.shape == (9, 16) and not hasattr(block, "shared_expert_gate")


def test_block_adds_the_gated_shared_expert():
    torch.manual_seed(0)
    h, e = 32, 8
    with tp_context(TPInfo(0, 1)):
        block = SparseMoeBlock(h, e, 2, 16, True, shared_intermediate_size=16)
    for p in block.parameters():
        p.normal_(0.0, 0.2)
    x = torch.randn(6, h)
    weights, ids, _ = block.gate(x)
    routed = block.experts(x, weights, ids)
    gate = torch.sigmoid(F.linear(x, block.gate.weight[e:]))  # [T, 1]
    torch.testing.assert_close(block(x), routed + gate * block.shared_expert(x), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("next")
    write_checkpoint(path, "qwen3_next", seed=3)
    return path


def load(path) -> torch.nn.Module:
    model = build_model(load_model_config(str(path)), TPInfo(0, 1), "cpu", torch.float32)
    load_weights(model, str(path), progress=False)
    return model


def test_separate_checkpoint_tensors_fill_the_fused_router(next_ckpt):
    original = load_file(str(next_ckpt / "model.safetensors"))
    model = load(next_ckpt)
    routers = [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers
    for name in routers:
        mlp = name.removesuffix(".gate.weight")
        want = torch.cat([original[f"{mlp}.gate.weight"], original[f"{mlp}.shared_expert_gate.weight"]])
        assert torch.equal(model.get_parameter(name), want), name


def copy_without(tmp_path, ckpt, name: str) -> Path:
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize("part", ["shared_expert_gate", "gate"])
def test_a_missing_part_is_named(tmp_path, next_ckpt, part):
    path = copy_without(tmp_path, next_ckpt, f"model.layers.1.mlp.{part}.weight")
    fused = r"model\.layers\.1\.mlp\.gate\.weight"
    pattern = rf"missing tensor 'model\.layers\.1\.mlp\.{part}\.weight' \(a part of fused parameter {fused}\)"
    with pytest.raises(CheckpointError, match=pattern):
        load(path)


def check_strided_views() -> None:
    """softmax_topk on the [T, E] view of [T, E + 1] logits; gated_add's sum on the [T, 1] column."""
    from ft.moe.kernels.triton_combine import launch_sum_topk
    from ft.moe.kernels.triton_router import launch_softmax_topk

    for t, e, k, renormalize in ((1, 8, 2, True), (7, 60, 4, False), (5, 128, 8, True)):
        logits = torch.randn(t, e + 1)
        experts, shared_logit = logits[:, :-1], logits[:, -1:]
        assert experts.stride(0) == e + 1 and shared_logit.stride(0) == e + 1
        weights, ids = launch_softmax_topk(experts, k, renormalize)
        ref_w, ref_ids = route(experts.contiguous(), k, renormalize)
        assert torch.equal(ids, ref_ids), (t, e, k)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
        y, shared = torch.randn(t, 1, 48), torch.randn(t, 48)
        got = launch_sum_topk(y, shared_logit, shared)
        torch.testing.assert_close(got, y[:, 0] + torch.sigmoid(shared_logit) * shared, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernels_read_strided_views_under_the_interpreter():
    run_check("tests.test_router_shared_gate", "check_strided_views", timeout=300)


def test_router_gemm_output_rows_are_padded_to_eight():
    """513 rows (512 experts + the shared gate) run as a 520-row GEMM over the same storage: the
    parameter stays [E + 1, H], the pad rows are zeros, and both logits read the right columns."""
    torch.manual_seed(1)
    router = TopKRouter(32, 12, 3, True, shared_gate=True)
    assert router.weight.shape == (13, 32) and router._padded.shape == (16, 32)
    assert router._padded.data_ptr() == router.weight.data_ptr() and not router._padded[13:].any()
    router.weight.normal_()  # in place: the padded storage sees it
    x = torch.randn(5, 32)
    weights, ids, shared_logit = router(x)
    ref_w, ref_ids = route(F.linear(x, router.weight[:12]), 3, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    torch.testing.assert_close(shared_logit, F.linear(x, router.weight[12:]))
    router.weight.data = router.weight.data.clone() * 2  # new storage: the padded copy is stale
    weights, ids, shared_logit = router(x)
    torch.testing.assert_close(shared_logit, F.linear(x, router.weight[12:]))
