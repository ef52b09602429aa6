"""The model as one rank builds it: the checkpoint's config as this engine changes it
(``effective_model_config``) and the module tree with its parameters allocated but not loaded
(``build_model``).

Not here: loading the weights (``ft.models.loader``, ``ft.models.dummy``), which class a
checkpoint builds (``ft.models.registry``), where the expert banks' experts live once built
(``ft.moe.backends.runtime``).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from ft.config import OFFLOAD_OPTIONS, EngineConfig
from ft.distributed import TPInfo, tp_context
from ft.models.config import ModelConfig
from ft.models.config_json import load_model_config
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


def model_config_of(cfg: EngineConfig, mc: ModelConfig | None = None) -> ModelConfig:
    """The config this engine builds (``effective_model_config``) of the checkpoint's (read from
    ``cfg.model_path`` unless given), with the options it cannot take refused (``check_fits``)."""
    mc = effective_model_config(cfg, mc or load_model_config(cfg.model_path))
    check_fits(cfg, mc)
    return mc


def check_fits(cfg: EngineConfig, mc: ModelConfig) -> None:
    """Refuse options the model cannot take, in the caller's process before any rank starts: a
    --max-model-len beyond its positions, a --tp-size its layers cannot shard, or an expert option
    on a model without routed experts, which would be ignored. ``--ple-backend`` on a model without
    a PLE table is only noted: the mission's one command line (``--ple-backend pinned``) serves
    Qwen3-Next as well as qwen4_exp. ``mc``: the effective config (``effective_model_config``)."""
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"EngineConfig.max_model_len={cfg.max_model_len} is beyond the model's "
            f"max_position_embeddings of {mc.max_position_embeddings}"
        )
    why = tp_refusal(mc, cfg.tp_size, cfg.torch_dtype(mc.dtype))
    if why:
        raise ValueError(f"EngineConfig.tp_size={cfg.tp_size} does not fit the model: {why}")
    if cfg.ple_backend != "device" and not mc.ple_layers:
        print(
            f"ft: --ple-backend {cfg.ple_backend}: the model has no PLE n-gram table (config.json's "
            "ple_layers), so there is nothing to place",
            file=sys.stderr,
            flush=True,
        )
    if "moe" not in mc.mlp_types:
        given = [(n, getattr(cfg, n)) for n in ("quantize_experts", *OFFLOAD_OPTIONS) if getattr(cfg, n)]
        given += [("moe_backend", cfg.moe_backend)] if cfg.moe_backend not in ("auto", "gpu") else []
        if given:
            raise ValueError(
                f"EngineConfig.{given[0][0]}={given[0][1]!r}: the model has no routed experts (every "
                "layer's MLP is dense), so there are none to place or quantise; leave the option out"
            )


def tp_refusal(mc: ModelConfig, tp_size: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the layers cannot shard ``mc`` over ``tp_size`` ranks (None when they can): whatever
    they refuse, on a model for the first rank built on the meta device, reading nothing. A model
    refused whatever the split (one rank too) raises that refusal as a ValueError instead: it is
    not the tensor parallelism's."""

    def refusal(size: int) -> str | None:
        try:
            build_model(mc, TPInfo(0, size), "meta", dtype)
        except ValueError as e:
            return str(e)
        return None

    why = refusal(tp_size)
    if why is not None and (tp_size == 1 or refusal(1) is not None):
        raise ValueError(why)
    return why


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
