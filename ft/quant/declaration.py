"""What a checkpoint declares about its quantisation, in one normalised form.

ModelOpt writes either ``quantization_config`` in config.json (``quant_method: "modelopt"``,
``quant_algo``, ``ignore`` patterns) or a separate ``hf_quant_config.json`` (``quantization.quant_algo``,
``quantization.exclude_modules``). Block-FP8 checkpoints declare ``quant_method: "fp8"`` with
``weight_block_size``. Patterns are shell-style (``model.layers.*.mlp.gate``) and match module
names; a module matching one stays unquantised. A quantised KV cache is refused.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

KV_CACHE_FIELDS = ("kv_cache_quant_algo", "kv_cache_scheme")  # either names a quantised KV cache


@dataclass(frozen=True)
class QuantDeclaration:
    method: str | None = None  # "modelopt" | "fp8" | None
    algo: str | None = None  # "NVFP4" | "FP8" ... as declared
    exclude: tuple[str, ...] = ()
    weight_block_size: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def excludes(self, module: str) -> bool:
        return any(
            fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in self.exclude
        )

    def format_of(self, module: str) -> str:
        """The storage format the checkpoint uses for the linear ``module`` (its name without .weight)."""
        if self.method is None or self.excludes(module):
            return "bf16"
        if self.algo == "NVFP4":
            return "nvfp4"
        if self.method == "fp8" and self.weight_block_size:
            return "fp8_block"
        raise ValueError(f"unsupported quantisation declaration: method {self.method!r}, algo {self.algo!r}")


def _refuse_kv_cache_quantisation(where: str, q: dict) -> None:
    for key in KV_CACHE_FIELDS:
        if q.get(key) is not None:
            raise ValueError(
                f"{where}.{key}: {q[key]!r} is not supported (the KV cache is kept in the model's dtype, "
                "with no k/v scales to load)"
            )


def parse_declaration(quantization_config: dict | None, hf_quant_config: dict | None) -> QuantDeclaration:
    if hf_quant_config:
        q = hf_quant_config.get("quantization", hf_quant_config)
        _refuse_kv_cache_quantisation("hf_quant_config.json quantization", q)
        return QuantDeclaration(
            "modelopt",
            q.get("quant_algo"),
            tuple(q.get("exclude_modules") or ()),
            None,
            dict(hf_quant_config),
        )
    qc = quantization_config or {}
    method = qc.get("quant_method")
    if method is None:
        return QuantDeclaration()
    _refuse_kv_cache_quantisation("config field quantization_config", qc)
    if method == "modelopt":
        return QuantDeclaration(
            "modelopt", qc.get("quant_algo"), tuple(qc.get("ignore") or ()), None, dict(qc)
        )
    if method == "fp8":
        block = tuple(qc.get("weight_block_size") or ())
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore") or ())
        return QuantDeclaration("fp8", "FP8", ignore, block or None, dict(qc))
    raise ValueError(
        f"config field quantization_config.quant_method: {method!r} is not supported (known: modelopt, fp8)"
    )
