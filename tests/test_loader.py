"""The strict loader: sharded checkpoints load; missing, unexpected, mis-shaped and half-fused
tensors are refused with an error naming the tensor and the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ft import LLM, SamplingParams
from ft.distributed import TPInfo
from ft.engine.build import build_model
from ft.models.checkpoint import CheckpointError
from ft.models.config_json import load_model_config
from ft.models.loader import load_weights
from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    write_checkpoint(path, "qwen3_moe", seed=1)
    return path


def edited(tmp_path, ckpt, edit) -> str:
    """A copy of the checkpoint with its tensors passed through ``edit``."""
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with (
        open(os.path.join(ckpt, "config.json")) as src,
        open(os.path.join(tmp_path, "config.json"), "w") as dst,
    ):
        dst.write(src.read())
    return str(tmp_path)


def load(path):
    mc = load_model_config(path)
    load_weights(build_model(mc, TPInfo(0, 1), "cpu", torch.float32), path, progress=False)


def test_missing_tensor_is_named(tmp_path, ckpt):
    path = edited(tmp_path, ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"
    ):
        load(path)


def test_half_fused_tensor_is_named(tmp_path, ckpt):
    path = edited(tmp_path, ckpt, lambda t: t.pop("model.layers.0.self_attn.v_proj.weight"))
    with pytest.raises(CheckpointError, match=r"v_proj\.weight'.*part of fused parameter .*qkv_proj"):
        load(path)


def test_unexpected_tensor_is_named(tmp_path, ckpt):
    def add(t):
        t["model.layers.0.mlp.experts.99.up_proj.weight"] = torch.zeros(16, 48)

    path = edited(tmp_path, ckpt, add)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.99.*model\.safetensors"
    ):
        load(path)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.mlp.experts.3.down_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
    ],
)
def test_misshaped_tensor_is_named(tmp_path, ckpt, name):
    def shrink(t):
        t[name] = t[name][..., :-1].contiguous()

    path = edited(tmp_path, ckpt, shrink)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*model\.safetensors: shape"):
        load(path)


@pytest.mark.parametrize("edit", ["shape", "dtype"])
def test_a_bad_tensor_is_named_before_any_tensor_is_read(tmp_path, ckpt, monkeypatch, edit):
    """Every loader checks its tensor's header (shape, dtype, the rank's slice) before the load
    reads any data: a bad tensor late in a checkpoint does not cost minutes of reading first."""
    from ft.models.checkpoint import CheckpointTensor

    def spoil(t):
        w = t["model.norm.weight"]
        t["model.norm.weight"] = w[:-1].contiguous() if edit == "shape" else w.to(torch.int32)

    path = edited(tmp_path, ckpt, spoil)
    reads = []
    for method in ("narrow", "read"):
        real = getattr(CheckpointTensor, method)
        monkeypatch.setattr(
            CheckpointTensor, method, lambda self, *a, real=real: reads.append(self.name) or real(self, *a)
        )
    with pytest.raises(CheckpointError, match=rf"'model\.norm\.weight' in .*model\.safetensors: {edit}"):
        load(path)
    assert reads == []


def test_sharded_checkpoint_with_index(tmp_path):
    hf = write_checkpoint(tmp_path / "one", "qwen3_next", seed=5)
    hf.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    outs = []
    for sub in ("one", "many"):
        with LLM(model=str(tmp_path / sub), device="cpu", dtype="float32", progress=False) as llm:
            outs.append(llm.generate([[3, 1, 4, 1, 5, 9, 2, 6]], params)[0])
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs


def test_index_naming_a_missing_file(tmp_path):
    hf = write_checkpoint(tmp_path / "one", "qwen3_moe")
    hf.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
    victim = sorted(p for p in os.listdir(tmp_path / "many") if p.endswith(".safetensors"))[-1]
    os.remove(tmp_path / "many" / victim)
    with pytest.raises(CheckpointError, match=victim):
        load(str(tmp_path / "many"))


@pytest.mark.parametrize("keep", [0, 20, "half", "all-but-one"])
def test_truncated_file_is_named(tmp_path, ckpt, keep):
    path = edited(tmp_path, ckpt, lambda t: None)
    file = os.path.join(path, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate({"half": size // 2, "all-but-one": size - 1}.get(keep, keep))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*(header|metadata)"):
        load(path)


def test_an_unreadable_file_is_named(tmp_path, ckpt):
    """safetensors' own OSError for a file it cannot map names no file ('No such device')."""
    path = edited(tmp_path, ckpt, lambda t: None)
    os.mkdir(os.path.join(path, "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: not a readable safetensors file"):
        load(path)


def sharded(tmp_path, edit_index) -> str:
    """A sharded copy of a tiny checkpoint with its index passed through ``edit_index``."""
    hf = write_checkpoint(tmp_path / "one", "qwen3_moe")
    hf.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
    index = tmp_path / "many" / "model.safetensors.index.json"
    index.write_text(edit_index(json.loads(index.read_text())))
    return str(tmp_path / "many")


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    def move(index):  # lm_head.weight, in the first shard, mapped to the last one instead
        files = sorted(set(index["weight_map"].values()))
        assert index["weight_map"]["lm_head.weight"] == files[0]
        index["weight_map"]["lm_head.weight"] = files[-1]
        return json.dumps(index)

    stale = r"'lm_head\.weight'.*index\.json.*maps it to .*model-0+(\d+)-of-0+\1\."
    with pytest.raises(CheckpointError, match=stale):
        load(sharded(tmp_path, move))


@pytest.mark.parametrize("text", ["{", '{"metadata": {}}'])
def test_malformed_index_is_named(tmp_path, text):
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        load(sharded(tmp_path, lambda index: text))
