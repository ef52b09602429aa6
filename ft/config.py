"""EngineConfig: every engine option in one frozen, validated place.

The CLI, the Python API and the server all build one of these; nothing below reads options from
anywhere else.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MOE_BACKENDS = ("auto", "gpu", "offload", "hybrid", "cpu")
CACHE_POLICIES = ("lru", "lfu")
# options that size an expert cache: given, the auto backend offloads (``MoeRuntime._choose``)
OFFLOAD_OPTIONS = ("expert_cache_fraction", "static_experts")
# a directory holding one of these has a tokenizer (``ft.api.load_tokenizer``)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
# the offloading backends' options at their defaults: another value means nothing to the gpu backend
STREAM_DEFAULTS = dict(
    moe_prefill_hit_d2d=False, moe_staging_experts=None, moe_stream_ahead=True, moe_prefetch=True,
    expert_cache_policy="lru", max_host_memory=None,
)  # fmt: skip
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(size: str | int | None, what: str = "size") -> int | None:
    """Bytes of ``48GiB``, ``48G`` / ``48GB`` (decimal), ``512MiB``, ``1.5TiB``, ``4096B`` or an int;
    ``what`` names the value in the error. A string without a unit (``48``) is refused: a user who
    meant 48 GiB would get 48 bytes and an engine with no room for anything."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", size.lower())
    if not m or (not m.group(2) and (m.group(3) or not m.group(4))):
        raise ValueError(f"{what}={size!r}: expected a number with a unit, e.g. 48GiB, 500MB or 4096B")
    number, unit, binary, _ = m.groups()
    scale = 1024 ** "_kmgt".index(unit) if binary else _UNITS[unit]
    return int(float(number) * scale)


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
    # also the number of GDN state slots; None: 64, fewer when the experts stream (sizing.default_running)
    max_running_requests: int | None = None
    # the chunked-prefill size; None: 8192, or up to 32768 when the experts stream
    # (``ft.moe.backends.sizing.prefill_chunk``: each chunk streams every host expert once)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    prefix_snapshot_slots: int | None = (
        None  # GDN state snapshots for the prefix cache (default: max_running)
    )
    cuda_graph_max_bs: int = 64
    # issue the next decode step before the last one's tokens are read (``LLMEngine.step``)
    decode_ahead: bool = True
    disable_cuda_graph: bool = False
    attention_backend: str = "auto"
    gdn_backend: str = "auto"
    quantize_experts: str | None = None  # "nvfp4": quantise bf16 routed experts while loading
    # where routed experts live (ft.moe.backends); auto: gpu when they fit, else offload
    moe_backend: str = "auto"
    max_gpu_memory: str | int | None = None  # cap on what the engine uses per GPU, e.g. "48GiB"
    max_host_memory: str | int | None = None  # host memory to plan the expert store for (default MemTotal)
    expert_cache_fraction: float | None = None  # slots per layer as a fraction of its experts
    expert_cache_policy: str = "lru"  # lru | lfu (frequency-aware)
    # experts per layer kept on the GPU only, with no host copy (a lean host store); default:
    # none when the host holds every expert, else the fewest that let it hold the rest; 0: never
    static_experts: int | None = None
    moe_prefetch: bool = True  # predict the next layer's experts from its router, copy them early
    moe_prefill_hit_d2d: bool = False  # prefill: copy resident experts into staging (else in place)
    moe_stream_ahead: bool = True  # long batches: stage each layer's first groups early (offload.py)
    moe_staging_experts: int | None = None  # experts per prefill staging buffer (default ~256 MiB)
    dummy_routing_skew: float = 0.0  # dummy routers prefer experts with a Zipf-like popularity
    ple_backend: str = "device"  # device | pinned: where a PLE n-gram table lives
    # sampling defaults for requests that leave them out (``ft.generation_config``): "auto" the
    # checkpoint's generation_config.json, "none" ft's own, or a directory holding one
    generation_config: str = "auto"
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
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"EngineConfig.tokenizer: {self.tokenizer!r} is not a directory")
        if self.tokenizer is not None and not any(
            os.path.exists(os.path.join(self.tokenizer, f)) for f in TOKENIZER_FILES
        ):
            raise ValueError(
                f"EngineConfig.tokenizer: {self.tokenizer!r} has no tokenizer files "
                f"({', '.join(TOKENIZER_FILES)})"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"EngineConfig.load_format: {self.load_format!r} (known: auto, dummy)")
        if self.model is None and self.load_format != "dummy":
            raise ValueError("EngineConfig: a config file without a checkpoint needs load_format='dummy'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"EngineConfig.device: {self.device!r} (known: auto, cpu, cuda)")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype: {self.dtype!r} (known: auto, {', '.join(DTYPES)})")
        if self.generation_config not in ("auto", "none") and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"EngineConfig.generation_config: {self.generation_config!r} (auto, none, or a directory)"
            )
        if self.ple_backend not in ("device", "pinned"):
            raise ValueError(f"EngineConfig.ple_backend: {self.ple_backend!r} (known: device, pinned)")
        if self.quantize_experts not in (None, "nvfp4"):
            raise ValueError(f"EngineConfig.quantize_experts: {self.quantize_experts!r} (known: None, nvfp4)")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(
                f"EngineConfig.moe_backend: {self.moe_backend!r} (known: {', '.join(MOE_BACKENDS)})"
            )
        if self.expert_cache_policy not in CACHE_POLICIES:
            raise ValueError(
                f"EngineConfig.expert_cache_policy: {self.expert_cache_policy!r} "
                f"(known: {', '.join(CACHE_POLICIES)})"
            )
        for name in ("max_gpu_memory", "max_host_memory"):
            size = parse_size(getattr(self, name), f"EngineConfig.{name}")
            if size is not None and size <= 0:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} must be positive")
        if self.max_gpu_memory is not None and self.resolved_device.type == "cpu":
            raise ValueError(
                f"EngineConfig.max_gpu_memory={self.max_gpu_memory!r} caps a GPU's memory, and this engine "
                "runs on cpu (--device): leave --max-gpu-memory out"
            )
        paged = self.block_size >= 16 and self.block_size & (self.block_size - 1) == 0
        if not paged and self.attention_backend != "torch" and self.resolved_device.type == "cuda":
            raise ValueError(
                f"EngineConfig.block_size={self.block_size}: the CUDA attention kernels (Triton) page "
                "the KV cache in blocks of a power of two >= 16; --block-size 16 is the default"
            )
        cache_options = [f"{n}={getattr(self, n)!r}" for n in OFFLOAD_OPTIONS if getattr(self, n) is not None]
        if self.moe_backend == "gpu" and cache_options:
            raise ValueError(
                f"EngineConfig.{cache_options[0]} sizes an expert cache, and the gpu MoE backend keeps every "
                "expert resident: use --moe-backend offload (or hybrid), or leave the backend to choose"
            )
        streaming = [
            f"{n}={getattr(self, n)!r}"
            for n, default in STREAM_DEFAULTS.items()
            if getattr(self, n) != default
        ]
        if self.moe_backend == "gpu" and streaming:
            raise ValueError(
                f"EngineConfig.{streaming[0]} changes how experts stream from the host, and the gpu MoE "
                "backend keeps every expert resident: use --moe-backend offload (or hybrid), or leave the "
                "backend to choose"
            )
        if self.dummy_routing_skew and self.load_format != "dummy":
            raise ValueError(
                f"EngineConfig.dummy_routing_skew={self.dummy_routing_skew!r} shapes the routers of dummy "
                "weights only: it needs load_format='dummy' (--load-format dummy)"
            )
        checks = [
            ("tp_size", self.tp_size >= 1),
            ("block_size", self.block_size >= 1),
            ("num_tokens", self.num_tokens is None or self.num_tokens >= self.block_size),
            ("memory_ratio", 0.0 < self.memory_ratio <= 1.0),
            ("max_running_requests", self.max_running_requests is None or self.max_running_requests >= 1),
            ("prefix_snapshot_slots", self.prefix_snapshot_slots is None or self.prefix_snapshot_slots >= 1),
            (
                "max_num_batched_tokens",
                self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            ),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1),
            ("dist_timeout_s", self.dist_timeout_s > 0),
            (
                "expert_cache_fraction",
                self.expert_cache_fraction is None or 0 < self.expert_cache_fraction <= 1,
            ),
            ("moe_staging_experts", self.moe_staging_experts is None or self.moe_staging_experts >= 1),
            ("static_experts", self.static_experts is None or self.static_experts >= 0),
            ("dummy_routing_skew", self.dummy_routing_skew >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} is out of range")

    @property
    def max_gpu_memory_bytes(self) -> int | None:
        return parse_size(self.max_gpu_memory)

    @property
    def max_host_memory_bytes(self) -> int | None:
        return parse_size(self.max_host_memory)

    @property
    def model_path(self) -> str:
        return self.model or self.config_file  # type: ignore[return-value]

    @property
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def model_len(self, max_position_embeddings: int) -> int:
        """The longest sequence served: --max-model-len, else the model's positions."""
        return self.max_model_len or max_position_embeddings

    def torch_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device.type == "cpu":
            return torch.float32
        return (
            DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
        )
