"""Strict safetensors loading: every checkpoint tensor maps to a parameter part, every parameter
part to a checkpoint tensor, and each rank reads only its slice.

The checks run on the file headers before any tensor data is read (the names here, each tensor's
shape, dtype and slice by its own weight loader handed a ``HeaderTensor``), so a wrong checkpoint
fails in seconds with the name of the first offending tensor and its file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from ft.models.checkpoint import CheckpointError, CheckpointTensor, HeaderTensor, Unread, open_file
from ft.quant import dequantized
from ft.quant.dequantized import Dequantize


@dataclass(frozen=True)
class Target:
    param_name: str
    param: nn.Parameter
    shard_id: object
    fused_into: str | None = None  # the parameter a part belongs to, for error messages


def read_index(path: str) -> dict[str, str] | None:
    """Tensor name -> file (a path) from the directory's model.safetensors.index.json, if it has one."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return None
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
    return {name: os.path.join(path, file) for name, file in weight_map.items()}


def checkpoint_files(path: str, weight_map: dict[str, str] | None) -> list[str]:
    """The safetensors files of a checkpoint directory, from its index (``read_index``) when there
    is one."""
    index = os.path.join(path, "model.safetensors.index.json")
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        for file in files:
            if not os.path.exists(file):
                raise CheckpointError(f"{index} lists {os.path.basename(file)}, which does not exist")
        return files
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return files


def expected_tensors(model: nn.Module) -> dict[str, Target]:
    """Checkpoint tensor name -> the parameter (and part of it) that loads it."""
    packed = getattr(model, "packed_modules", {})
    out: dict[str, Target] = {}
    for pname, param in model.named_parameters():
        prefix, _, leaf = pname.rpartition(".")
        if hasattr(param, "checkpoint_parts"):
            for rel, shard in param.checkpoint_parts:
                out[f"{prefix}.{rel}"] = Target(pname, param, shard, pname)
            continue
        parent, _, module = prefix.rpartition(".")
        if module in packed:
            for i, part in enumerate(packed[module]):
                out[f"{parent}.{part}.{leaf}".lstrip(".")] = Target(pname, param, i, pname)
        else:
            out[pname] = Target(pname, param, None)
    return out


def read_headers(files: list[str]) -> dict[str, str]:
    """Tensor name -> file, from the headers alone."""
    where: dict[str, str] = {}
    for file in files:
        with open_file(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name in where:
                    raise CheckpointError(f"tensor {name!r} appears in both {where[name]} and {file}")
                where[name] = file
    return where


def dequantized_modules(model: nn.Module, expected: dict[str, Target]) -> dict[str, Dequantize]:
    """The checkpoint modules stored quantised whose weight the model loads as float
    (``model.dequantized``, set at build by ``ft.quant.dense``), of those it loads at all."""
    return {m: how for m, how in getattr(model, "dequantized", {}).items() if f"{m}.weight" in expected}


def check_names(
    model: nn.Module, where: dict[str, str], path: str
) -> tuple[dict[str, Target], dict[str, Dequantize]]:
    """(checkpoint tensor -> target, the modules whose weight loads dequantised), after checking
    that every tensor has a target or is a dequantised weight's companion, and the reverse."""
    expected = expected_tensors(model)
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_tensors", ())]
    as_float = dequantized_modules(model, expected)
    beside = {c for m, how in as_float.items() for c in dequantized.companions(m, how)}
    for name, file in where.items():
        if name not in expected and name not in beside and not any(p.search(name) for p in ignored):
            raise CheckpointError(f"unexpected tensor {name!r} in {file}: the model has no parameter for it")
    for name, target in expected.items():
        if name not in where:
            part = f" (a part of fused parameter {target.fused_into})" if target.fused_into else ""
            raise CheckpointError(f"missing tensor {name!r}{part}: not found in any file of {path}")
    return expected, as_float


def dequantize_device(param: torch.Tensor) -> torch.device:
    """Where a weight that loads into ``param`` dequantised is computed: on the device the model
    runs on for an offloaded bank's experts (``dequantize_on``: their host rows and cache slots,
    ``ft.moe.backends.placement``; a checkpoint's FP8 bytes cross PCIe and the bf16 ones come
    back, where the CPU would spend minutes of an 80B load), else on ``param``'s device, so that a
    layer's loader copies device to device, or on the CPU for a ``meta`` one."""
    on = getattr(param, "dequantize_on", None)
    if on is not None:
        return on
    return torch.device("cpu") if param.device.type == "meta" else param.device


@torch.no_grad()
def load_weights(model: nn.Module, path: str, progress: bool = True) -> int:
    """Load ``model`` from the checkpoint directory ``path``; returns the number of tensors read."""
    weight_map = read_index(path)
    files = checkpoint_files(path, weight_map)
    where = read_headers(files)
    for name, file in (weight_map or {}).items():
        if where.get(name) != file:  # else a stale index reads as a missing tensor, or not at all
            raise CheckpointError(
                f"tensor {name!r}: model.safetensors.index.json of {path} maps it to {file}, "
                "which does not hold it"
            )
    expected, dequantize = check_names(model, where, path)
    as_float = {f"{m}.weight": (m, how) for m, how in dequantize.items()}
    todo = [n for n in where if n in expected]

    def load(name: str, tensor) -> None:
        target, ckpt = expected[name], tensor(name)
        if name in as_float:  # the layer loads it as a float tensor
            device = dequantize_device(target.param)
            ckpt = dequantized.open_dequantized(ckpt, *as_float[name], where, tensor, device=device)
        target.param.weight_loader(target.param, ckpt, target.shard_id)

    with OpenFiles(where) as opened:
        for name in todo:  # every tensor's checks first: a bad one late in the files costs no reading
            try:
                load(name, opened.header)
            except Unread:
                pass
        bar = tqdm(total=len(todo), desc="loading weights", unit="tensor", disable=not progress)
        for file in files:
            for name in (n for n in todo if where[n] == file):
                load(name, opened.tensor)
                bar.update()
            opened.close(file)
        bar.close()
    return len(todo)


class OpenFiles:
    """The checkpoint's files, each opened once by the header checks and kept until it has loaded,
    and again whenever a tensor loading from another file needs one of its tensors (a dequantised
    weight's scales): an open parses the file's whole header, tens of milliseconds for a shard of
    a 512-expert model, so one per dequantised tensor added minutes to a block-FP8 load."""

    def __init__(self, where: dict[str, str]) -> None:
        self.where, self.handles = where, {}

    def tensor(self, name: str, kind: type[CheckpointTensor] = CheckpointTensor) -> CheckpointTensor:
        file = self.where[name]
        if file not in self.handles:
            self.handles[file] = open_file(file).__enter__()
        return kind(name, file, self.handles[file])

    def header(self, name: str) -> HeaderTensor:
        """``name`` as a ``HeaderTensor``: its checks, none of its data."""
        return self.tensor(name, HeaderTensor)

    def close(self, file: str) -> None:
        handle = self.handles.pop(file, None)
        if handle is not None:
            handle.__exit__(None, None, None)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc) -> None:
        for file in list(self.handles):
            self.close(file)
