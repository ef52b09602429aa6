"""From a checkpoint's config.json to a ``ModelConfig``: read the file (with the stop ids of
generation_config.json and ModelOpt's hf_quant_config.json), then flatten it per family.

Known model types are parsed through transformers' config classes (so their defaults and the
older top-level ``rope_theta`` / ``partial_rotary_factor`` fields both resolve), except families
whose contract is a spec of ours (``SPEC_MODEL_TYPES``); each family's parser (``PARSERS``) turns
the result into plain numbers. Layers never see the Hugging Face config object.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ft.models.config import ModelConfig
from ft.quant.declaration import QuantDeclaration, parse_declaration


def _rope(raw: dict[str, Any]) -> tuple[float, float]:
    """(theta, partial factor) from either the ``rope_parameters`` form or the older top-level one."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"config field rope_type: {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _mlp_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("num_experts", 0) <= 0:
        return ("dense",) * n
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple("moe" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(n))


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Flatten a (transformers-normalised) config dict into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in PARSERS:
        raise ValueError(
            f"config field model_type: {model_type!r} is not supported (known: {sorted(PARSERS)})"
        )
    return PARSERS[model_type](raw)


def _expert_format(quant: QuantDeclaration, moe_layers: list[int]) -> str:
    """The bank format of the one format the declaration gives every routed expert projection
    (block-FP8 experts fill a bf16 bank, dequantised as they load): a bank serves every
    layer in one format, so a layer or projection excluded from NVFP4 alone is refused (it would
    be quantised at load unasked, or, were it the first, refuse the next layer's bank)."""
    example: dict[str, str] = {}
    for i in moe_layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = f"model.layers.{i}.mlp.experts.0.{proj}"
            example.setdefault(quant.format_of(module), module)
    if len(example) > 1:
        shown = " and ".join(f"{m} {f}" for f, m in sorted(example.items(), key=lambda fm: fm[0] == "bf16"))
        raise ValueError(
            f"routed experts must all have one format, but the quantisation declaration stores {shown}"
        )
    fmt = next(iter(example))
    return "bf16" if fmt == "fp8_block" else fmt  # block-FP8 experts load dequantised (ft.quant.dequantized)


def _default(value, default):
    """``value`` unless it is None (not unless it is falsy: a 0 is the config's, and refused)."""
    return default if value is None else value


COMMON_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _common(raw: dict[str, Any]) -> dict[str, Any]:
    for name in COMMON_REQUIRED:  # transformers' defaults fill them, except for a family of ours
        if name not in raw:
            raise ValueError(f"config field {name}: required for {raw['model_type']}")
        if not isinstance(raw[name], int) or raw[name] < 1:  # before the sizes derived from them
            raise ValueError(f"config field {name}: {raw[name]!r} must be a positive integer")
    n = raw["num_hidden_layers"]
    theta, factor = _rope(raw)
    head_dim = _default(raw.get("head_dim"), raw["hidden_size"] // raw["num_attention_heads"])
    quant = parse_declaration(raw.get("quantization_config"), raw.get("hf_quant_config"))
    mlp_types = _mlp_types(raw, n)
    moe = [i for i, t in enumerate(mlp_types) if t == "moe"]  # a dense layer 0 declares no expert format
    return dict(
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=n,
        mlp_types=mlp_types,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        num_heads=raw["num_attention_heads"],
        num_kv_heads=_default(raw.get("num_key_value_heads"), raw["num_attention_heads"]),  # None: MHA
        head_dim=head_dim,
        rope_theta=theta,
        partial_rotary_factor=factor,
        attention_bias=bool(raw.get("attention_bias", False)),
        num_experts=raw.get("num_experts", 0),
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        intermediate_size=raw.get("intermediate_size", 0),
        eos_token_ids=_eos(raw),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16").replace("torch.", ""),
        expert_format=_expert_format(quant, moe or [0]),
        quantization=quant,
    )


def _qwen3_moe(raw: dict[str, Any]) -> ModelConfig:
    n = raw["num_hidden_layers"]
    return ModelConfig(layer_types=("full_attention",) * n, **_common(raw))


def _qwen3_next(raw: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        layer_types=tuple(raw["layer_types"]),
        attn_output_gate=True,
        zero_centered_norm=True,
        linear_num_key_heads=raw["linear_num_key_heads"],
        linear_num_value_heads=raw["linear_num_value_heads"],
        linear_key_head_dim=raw["linear_key_head_dim"],
        linear_value_head_dim=raw["linear_value_head_dim"],
        linear_conv_kernel_dim=raw["linear_conv_kernel_dim"],
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
        **_common(raw),
    )


PLE_PRIME_ESTIMATE = 2**21  # spec section 10: "primes near 2^21", for configs without a checkpoint


def _checkpoint_tensor_shape(path: str | None, name: str) -> tuple[int, ...] | None:
    """The shape of tensor ``name`` from the safetensors headers of checkpoint directory ``path``."""
    if not path or not os.path.isdir(path):
        return None
    from ft.models.checkpoint import open_file

    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with open_file(os.path.join(path, file)) as f:
            if name in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return tuple(f.get_slice(name).get_shape())
    return None


QWEN4_EXP_REQUIRED = (
    "layer_types", "qsa_block_size", "qsa_topk_blocks", "qsa_local_blocks", "qsa_index_heads",
    "qsa_index_head_dim",
)  # fmt: skip
QWEN4_EXP_GDN = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip
QWEN4_EXP_OPTIONAL = dict(
    shared_expert_intermediate_size=512, hc_mult=1, hc_sinkhorn_iters=1, hc_eps=1e-6, ple_heads=0,
    ple_head_dim=0, ple_pad_id=0,
)  # fmt: skip
# Fields the spec lists without a default take Qwen3-Next's (transformers' Qwen3NextConfig), as
# the spec says where it is silent: a missing partial_rotary_factor rotates a quarter of each head.
QWEN4_EXP_QWEN3_NEXT_DEFAULTS = dict(
    num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, num_experts=512,
    num_experts_per_tok=10, moe_intermediate_size=512, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)  # fmt: skip


def _qwen4_exp(raw: dict[str, Any]) -> ModelConfig:
    raw = QWEN4_EXP_QWEN3_NEXT_DEFAULTS | raw
    for name in QWEN4_EXP_REQUIRED:
        if name not in raw:
            raise ValueError(f"config field {name}: required for qwen4_exp")
    fields = {k: raw[k] for k in QWEN4_EXP_REQUIRED + QWEN4_EXP_GDN} | {
        k: raw.get(k, v) for k, v in QWEN4_EXP_OPTIONAL.items()
    }
    ple_layers = tuple(raw.get("ple_layers") or ())
    orders = tuple(raw.get("ple_ngram_orders") or ())
    rows = 0
    if ple_layers:
        # The table has R = sum(primes) rows: a fact of the checkpoint, read from its header when
        # there is one; a bare config gets the spec's estimate (or an explicit ple_table_rows).
        shape = _checkpoint_tensor_shape(raw.get("_checkpoint_dir"), "model.ple.table")
        count = len(ple_layers) * len(orders) * fields["ple_heads"]
        rows = shape[0] if shape else raw.get("ple_table_rows") or count * PLE_PRIME_ESTIMATE
    return ModelConfig(
        **(fields | dict(layer_types=tuple(raw["layer_types"]), hc_eps=float(fields["hc_eps"]))),
        zero_centered_norm=True,
        attn_output_gate=True,
        ple_layers=ple_layers,
        ple_ngram_orders=orders,
        ple_table_rows=rows,
        **_common(raw),
    )


PARSERS = {"qwen3_moe": _qwen3_moe, "qwen3_next": _qwen3_next, "qwen4_exp": _qwen4_exp}


# Families whose contract is a spec of ours (shared/specs/), read exactly as written: transformers
# ships an unrelated model under the name qwen4_exp (a multimodal config with other field names).
SPEC_MODEL_TYPES = ("qwen4_exp",)


def _read_json(file: str) -> dict[str, Any]:
    with open(file) as f:
        try:
            body = json.load(f)
        except json.JSONDecodeError as e:  # its message names a line, not the file
            raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ValueError(f"{file}: not a JSON object (a {type(body).__name__})")
    return body


def _config_file(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def load_raw_config(path: str) -> dict[str, Any]:
    """config.json of a checkpoint directory (or a config file), normalised by transformers if known."""
    file = _config_file(path)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {path}")
    raw = _read_json(file)
    generation = os.path.join(os.path.dirname(file), "generation_config.json")
    if os.path.exists(generation):  # instruct models list extra stop ids (e.g. <|endoftext|>) here
        extra = _read_json(generation).get("eos_token_id")
        ids = (
            [raw.get("eos_token_id")]
            if not isinstance(raw.get("eos_token_id"), list)
            else raw["eos_token_id"]
        )
        extra = extra if isinstance(extra, list) else [extra]
        raw["eos_token_id"] = [i for i in dict.fromkeys(ids + extra) if i is not None] or None
    modelopt = os.path.join(os.path.dirname(file), "hf_quant_config.json")
    if os.path.exists(modelopt):
        raw["hf_quant_config"] = _read_json(modelopt)
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - transformers is a dependency
        return raw
    if raw.get("model_type") in CONFIG_MAPPING and raw.get("model_type") not in SPEC_MODEL_TYPES:
        try:
            hf = AutoConfig.for_model(**raw)
        except Exception as e:  # transformers' own validation: keep its message, our error type
            raise ValueError(f"{file}: {e}") from e
        merged = hf.to_dict()
        for alias, target in getattr(
            hf, "attribute_map", {}
        ).items():  # e.g. num_experts -> num_local_experts
            merged[alias] = merged.get(target)
        merged.setdefault("quantization_config", raw.get("quantization_config"))
        merged["hf_quant_config"] = raw.get("hf_quant_config")
        return merged
    if os.path.isdir(path):
        raw["_checkpoint_dir"] = path  # for facts only the tensors carry (qwen4_exp's PLE table rows)
    return raw


def load_model_config(path: str) -> ModelConfig:
    raw = load_raw_config(path)
    try:
        return config_from_dict(raw)
    except ValueError as e:  # its message names the field, not the file
        raise ValueError(f"{_config_file(path)}: {e}") from None
