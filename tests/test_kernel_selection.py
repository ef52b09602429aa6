"""Kernel choice at start-up: attention/GDN "auto" and the MoE selection table (runs on CPU)."""

from __future__ import annotations

import pytest
import torch

from ft.attention import get_attention_backend
from ft.gdn import get_gdn_backend
from ft.moe.kernels.select import MOE_KERNELS, KernelSelectionError, KernelSpec, select_moe_kernel
from ft.moe.kernels.torch_ref import fused_moe_ref


def test_moe_kernel_selection():
    name, kernel = select_moe_kernel("bf16", "cpu", tp_size=2)
    assert name == "torch-ref" and kernel is fused_moe_ref
    with pytest.raises(KernelSelectionError) as err:
        select_moe_kernel("int3", "cpu")
    for spec in MOE_KERNELS:  # every candidate is listed with its reason
        assert f"{spec.name}: format 'int3'" in str(err.value)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        pytest.importorskip("triton")
        assert select_moe_kernel("bf16", "cuda")[0] == "triton-bf16"


def test_refusal_reasons_name_each_rule():
    old_gpu = KernelSpec("k", "x:y", ("bf16",), ("cuda",), min_capability=(99, 0), tp_ok=False)
    assert "device 'cpu'" in old_gpu.refusal("bf16", torch.device("cpu"), 1)
    no_tp = KernelSpec("k", "x:y", ("bf16",), ("any",), tp_ok=False)
    assert no_tp.refusal("bf16", torch.device("cpu"), 1) is None
    assert "tensor parallelism" in no_tp.refusal("bf16", torch.device("cpu"), 2)
    missing = KernelSpec("k", "x:y", ("bf16",), ("any",), needs=("no_such_module_ft",))
    assert "cannot import no_such_module_ft" in missing.refusal("bf16", torch.device("cpu"), 1)
    with pytest.raises(KernelSelectionError, match="k: cannot import"):
        select_moe_kernel("bf16", "cpu", candidates=(missing,))


def test_auto_backends_fall_back_to_torch():
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_gdn_backend("auto", "cpu").name == "torch"
    try:
        import triton  # noqa: F401
    except ImportError:  # CPU CI: "auto" on CUDA must still work, through the reference
        assert get_attention_backend("auto", "cuda").name == "torch"
    with pytest.raises(ValueError, match="known: auto, triton, torch"):
        get_attention_backend("flash", "cuda")
    with pytest.raises(ValueError, match="known: auto, fla, torch"):
        get_gdn_backend("flash", "cuda")


def test_gdn_auto_on_cuda_without_fla_says_it_falls_back(monkeypatch, capsys):
    import ft.gdn

    def missing():
        raise ImportError("No module named 'fla'")

    monkeypatch.setattr(ft.gdn, "_fla", missing)
    assert get_gdn_backend("auto", "cuda").name == "torch"
    assert "flash-linear-attention does not import" in capsys.readouterr().out
