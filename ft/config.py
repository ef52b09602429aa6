"""EngineConfig: every engine option in one frozen, validated place.

The CLI, the Python API and the server all build one of these; nothing below reads options from
anywhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory
    config_file: str | None = None  # a config.json alone, for --load-format dummy
    tokenizer: str | None = None  # defaults to the model directory
    tp_size: int = 1
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | dummy
    block_size: int = 16
    num_tokens: int | None = None  # KV pool size in tokens
    memory_ratio: float = 0.90
    max_running_requests: int = 64  # also the number of GDN state slots
    max_num_batched_tokens: int = 8192  # the chunked-prefill size
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    prefix_snapshot_slots: int | None = (
        None  # GDN state snapshots for the prefix cache (default: max_running)
    )
    cuda_graph_max_bs: int = 64
    disable_cuda_graph: bool = False
    attention_backend: str = "auto"
    gdn_backend: str = "auto"
    quantize_experts: str | None = None  # "nvfp4": quantise bf16 routed experts while loading
    ple_backend: str = "device"  # device | pinned: where a PLE n-gram table lives
    seed: int = 0
    dist_timeout_s: float = 1800.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.model is None and self.config_file is None:
            raise ValueError(
                "EngineConfig: give a model directory (model=...) or a config file (config_file=...)"
            )
        if self.model is not None and not os.path.isdir(self.model):
            raise ValueError(f"EngineConfig.model: {self.model!r} is not a directory")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"EngineConfig.load_format: {self.load_format!r} (known: auto, dummy)")
        if self.model is None and self.load_format != "dummy":
            raise ValueError("EngineConfig: a config file without a checkpoint needs load_format='dummy'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"EngineConfig.device: {self.device!r} (known: auto, cpu, cuda)")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype: {self.dtype!r} (known: auto, {', '.join(DTYPES)})")
        if self.ple_backend not in ("device", "pinned"):
            raise ValueError(f"EngineConfig.ple_backend: {self.ple_backend!r} (known: device, pinned)")
        if self.quantize_experts not in (None, "nvfp4"):
            raise ValueError(f"EngineConfig.quantize_experts: {self.quantize_experts!r} (known: None, nvfp4)")
        checks = [
            ("tp_size", self.tp_size >= 1),
            ("block_size", self.block_size >= 1),
            ("num_tokens", self.num_tokens is None or self.num_tokens >= self.block_size),
            ("memory_ratio", 0.0 < self.memory_ratio <= 1.0),
            ("max_running_requests", self.max_running_requests >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("dist_timeout_s", self.dist_timeout_s > 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} is out of range")

    @property
    def model_path(self) -> str:
        return self.model or self.config_file  # type: ignore[return-value]

    @property
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device.type == "cpu":
            return torch.float32
        return (
            DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
        )
