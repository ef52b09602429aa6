"""What loading a quantised checkpoint dequantised costs, and where its tensors may lie: a sharded
block-FP8 checkpoint whose scales sit in another file than their weights (index included) loads
as the single-file one does, opening each file a bounded number of times however many tensors
it dequantises; a declaration listing a pattern or two a layer (Qwen's FP8 releases) does not
make the build's per-expert format look-ups slow, and decides as shell patterns do."""

from __future__ import annotations

import fnmatch
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import ft.models.checkpoint
from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.config_json import config_from_dict, load_model_config
from ft.models.loader import load_weights
from ft.quant.declaration import parse_declaration
from tests.checkpoints import QWEN3_MOE_BASE
from tests.quant.test_fp8_checkpoints import write_fp8_checkpoint


def shard_apart(src, dst) -> list[str]:
    """``src``'s one file as two, each weight's ``weight_scale_inv`` in the other file from its
    weight, with an index; returns the files."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    weights = sorted(n for n in tensors if not n.endswith("_scale_inv"))
    first = set(weights[::2])  # the other half of the weights in the second file
    for name in list(tensors):
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") not in first:
            first.add(name)  # its weight is in the second file
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    a, b = files.values()
    for name, tensor in tensors.items():
        (a if name in first else b)[name] = tensor
    for file, part in files.items():
        save_file(part, str(dst / file))
    weight_map = {n: f for f, part in files.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(files)


def loaded(path) -> dict[str, torch.Tensor]:
    model = build_model(load_model_config(str(path)), TPInfo(0, 1), "cpu", torch.float32)
    load_weights(model, str(path), progress=False)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_sharded_fp8_checkpoint_opens_each_file_a_few_times_with_scales_elsewhere(tmp_path, monkeypatch):
    """An open parses the file's whole header (tens of ms for a shard of a 512-expert model):
    opened per dequantised tensor, Qwen3-Next-80B's 74k FP8 experts took many minutes more."""
    write_fp8_checkpoint(tmp_path, "qwen3_moe", seed=31)
    files = shard_apart(tmp_path / "fp8", tmp_path / "sharded")
    opens = []

    def counted(file, *args, **kwargs):
        opens.append(file)
        return real(file, *args, **kwargs)

    real = ft.models.checkpoint.safe_open
    want = loaded(tmp_path / "fp8")
    monkeypatch.setattr(ft.models.checkpoint, "safe_open", counted)
    got = loaded(tmp_path / "sharded")
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    assert len(opens) <= 3 * len(files), f"{len(opens)} opens of {len(files)} files"


QWEN_FP8_LAYERS = 48


def test_a_long_exclude_list_keeps_the_build_quick():
    """Qwen's FP8 releases list each layer's router (and shared-expert gate) by name, and the build
    asks the declaration the format of every expert projection (3 x 512 x 48 of them here): one
    fnmatch a pattern and module took tens of seconds a build, and a start builds several."""
    n = QWEN_FP8_LAYERS
    raw = QWEN3_MOE_BASE | dict(
        model_type="qwen3_moe", num_hidden_layers=n, num_experts=512, num_experts_per_tok=8
    )
    ignore = ["lm_head"] + [
        f"model.layers.{i}.mlp.{m}" for i in range(n) for m in ("gate", "shared_expert_gate")
    ]
    plain = config_from_dict(raw)
    fp8 = config_from_dict(
        raw
        | {
            "quantization_config": {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ignore,
            }
        }
    )

    def seconds(mc) -> tuple[float, torch.nn.Module]:
        start = time.perf_counter()
        model = build_model(mc, TPInfo(0, 1), "meta", torch.bfloat16)
        return time.perf_counter() - start, model

    seconds(plain)  # imports
    base, _ = seconds(plain)
    took, model = seconds(fp8)
    assert len(model.dequantized) >= 3 * 512 * n
    assert took - base < 2.0, f"{took:.1f} s to build, {base:.1f} s unquantised"


@pytest.mark.parametrize(
    "pattern",
    [
        "lm_head",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp",
        "model.layers.*.mlp.gate",
        "*.mlp.gate",
        "*mlp.gate*",
        "model.layers.[02].self_attn*",
        "model.layers.?.mlp.experts.1?.up_proj",
        "model.layers.1.mlp.experts.",
        "*",
    ],
)
def test_exclude_patterns_decide_as_shell_patterns_on_the_module_and_below(pattern):
    modules = [
        f"model.layers.{i}.{m}"
        for i in (0, 1, 2, 10)
        for m in (
            "mlp.gate",
            "mlp.gate_proj",
            "mlp.shared_expert_gate",
            "mlp.experts.1.up_proj",
            "mlp.experts.12.up_proj",
            "self_attn.q_proj",
        )
    ] + ["lm_head", "lm_head_extra", "model.embed_tokens"]
    decl = parse_declaration(
        {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": [pattern]}, None
    )
    for module in modules:
        want = fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
        assert decl.excludes(module) == want, (pattern, module)


def test_fp8_block_tensor_dequantises_by_block_and_reads_only_a_rank_slice(tmp_path):
    """``w[r, c] = weight[r, c] · scale_inv[r // bn, c // bk]`` on ragged last blocks, for rows and
    for columns from inside a block; a rank's columns (row-parallel, an expert's down projection
    under TP) read those columns, not the whole weight dequantised."""
    from safetensors import safe_open

    from ft.models.checkpoint import CheckpointTensor
    from ft.quant.dequantized import Fp8BlockTensor

    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(37, 70, generator=gen) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=gen) + 0.5  # blocks of 16 x 32: 37 = 16 + 16 + 5, 70 = 32 + 32 + 6
    save_file({"w": weight, "s": scale}, str(tmp_path / "t.safetensors"))
    want = torch.tensor(
        [[float(weight[r, c]) * float(scale[r // 16, c // 32]) for c in range(70)] for r in range(37)]
    )
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as handle:
        t = Fp8BlockTensor(CheckpointTensor("w", "f", handle), CheckpointTensor("s", "f", handle), (16, 32))
        asked = []
        narrow = t._weight.narrow
        t._weight.narrow = lambda dim, start, length: (
            asked.append((dim, start, length)) or narrow(dim, start, length)
        )
        assert torch.equal(t.read(), want)
        assert torch.equal(t.narrow(0, 13, 22), want[13:35])
        asked.clear()
        assert torch.equal(t.narrow(1, 20, 45), want[:, 20:65])
        assert asked == [(1, 20, 45)]


def test_an_all_zero_nvfp4_projection_loads_as_zeros(tmp_path):
    """ModelOpt's global is amax / (6 · 448): 0 for an all-zero weight, as ``nvfp4.quantize`` makes
    it and the NVFP4 expert bank takes it; a dense projection takes it too (a negative is refused)."""
    from safetensors import safe_open

    from ft.models.checkpoint import CheckpointError, CheckpointTensor
    from ft.quant import nvfp4
    from ft.quant.dequantized import Nvfp4Tensor

    q = nvfp4.quantize(torch.zeros(8, 32))
    assert float(q.weight_scale_2) == 0.0
    tensors = {"w": q.weight, "s": q.weight_scale, "g": q.weight_scale_2, "neg": torch.tensor(-1.0)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        codes, scale = CheckpointTensor("w", "f", f), CheckpointTensor("s", "f", f)
        assert torch.equal(
            Nvfp4Tensor(codes, scale, CheckpointTensor("g", "f", f)).read(), torch.zeros(8, 32)
        )
        with pytest.raises(CheckpointError, match=r"'neg' in f: value -1\.0"):
            Nvfp4Tensor(codes, scale, CheckpointTensor("neg", "f", f))


@pytest.mark.parametrize(
    "model_type,tp,overrides",
    [("qwen3_moe", 4, {}), ("qwen3_next", 2, {"num_key_value_heads": 1, "tie_word_embeddings": True})],
)
def test_every_rank_holds_the_slices_of_the_dequantised_checkpoint(tmp_path, model_type, tp, overrides):
    """Replicated kv heads (2 over 4 ranks, 1 over 2), expert rows inside a 16-row block, row-parallel
    columns inside a 32-column one, GDN's key-head groups, tied embeddings, MTP tensors ignored:
    each rank's parameters from the FP8 checkpoint equal those from its fp32 dequantisation."""
    write_fp8_checkpoint(tmp_path, model_type, seed=32, **overrides)
    if model_type == "qwen3_next":  # an MTP layer, stored FP8 like the rest, which we do not run
        path = tmp_path / "fp8" / "model.safetensors"
        tensors = load_file(str(path))
        tensors["mtp.fc.weight"] = torch.zeros(48, 96).to(torch.float8_e4m3fn)
        tensors["mtp.fc.weight_scale_inv"] = torch.ones(3, 3)
        save_file(tensors, str(path))
    for rank in range(tp):
        states = []
        for sub in ("fp8", "dequant"):
            model = build_model(
                load_model_config(str(tmp_path / sub)), TPInfo(rank, tp), "cpu", torch.float32
            )
            load_weights(model, str(tmp_path / sub), progress=False)
            states.append(model.state_dict())
        fp8, dequant = states
        assert fp8.keys() == dequant.keys()
        for name, value in fp8.items():
            assert torch.equal(value, dequant[name]), (rank, name)
