"""model_type -> model class."""

from __future__ import annotations

from ft.models.config import ModelConfig
from ft.models.decoder import CausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    from ft.models.qwen3_moe import Qwen3MoeForCausalLM
    from ft.models.qwen3_next import Qwen3NextForCausalLM
    from ft.models.qwen4_exp.model import Qwen4ExpForCausalLM

    classes = {
        "qwen3_moe": Qwen3MoeForCausalLM,
        "qwen3_next": Qwen3NextForCausalLM,
        "qwen4_exp": Qwen4ExpForCausalLM,
    }
    if cfg.model_type not in classes:
        raise ValueError(f"no model for model_type {cfg.model_type!r} (known: {sorted(classes)})")
    return classes[cfg.model_type]
