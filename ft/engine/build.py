"""The model as one rank builds it: the checkpoint's config as this engine changes it
(``effective_model_config``) and the module tree with its parameters allocated but not loaded
(``build_model``).

Not here: loading the weights (``ft.models.loader``, ``ft.models.dummy``), which class a
checkpoint builds (``ft.models.registry``), where the expert banks' experts live once built
(``ft.moe.backends.runtime``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ft.config import EngineConfig
from ft.distributed import TPInfo, tp_context
from ft.models.config import ModelConfig
from ft.models.registry import model_class
from ft.moe.backends import banks_on


def effective_model_config(cfg: EngineConfig, mc: ModelConfig) -> ModelConfig:
    """The checkpoint's config as this engine builds it (``--quantize-experts`` changes the banks,
    ``--ple-backend pinned`` moves the n-gram table to host memory)."""
    if cfg.quantize_experts:  # the bank quantises whatever the checkpoint stores in bf16
        mc = replace(mc, expert_format=cfg.quantize_experts)
    if cfg.ple_backend == "pinned" and mc.ple_layers:
        mc = replace(mc, ple_on_host=True)
    return mc


def build_model(
    mc: ModelConfig,
    tp: TPInfo,
    device: torch.device | str,
    dtype: torch.dtype,
    bank_device: torch.device | str | None = None,
) -> torch.nn.Module:
    """The model for this rank, parameters allocated (uninitialised) on ``device``; expert banks'
    on ``bank_device`` when given (``meta``: left for a host store to adopt)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with tp_context(tp), torch.device(device), banks_on(bank_device):
            return model_class(mc)(mc)
    finally:
        torch.set_default_dtype(previous)
