"""What a checkpoint declares about its quantisation, in one normalised form.

ModelOpt writes either ``quantization_config`` in config.json (``quant_method: "modelopt"``,
``quant_algo``, ``ignore`` patterns) or a separate ``hf_quant_config.json`` (``quantization.quant_algo``,
``quantization.exclude_modules``). Block-FP8 checkpoints declare ``quant_method: "fp8"`` with
``weight_block_size``. Patterns are shell-style (``model.layers.*.mlp.gate``) and match module
names; a module matching one stays unquantised. A quantised KV cache (``kv_cache_quant_algo``,
``kv_cache_scheme``: ModelOpt's NVFP4 exports often declare FP8) is not used: the cache stays in
the model's dtype, as vLLM keeps it unless asked for an FP8 cache, and the checkpoint's k/v scale
tensors (``KV_SCALES``) are skipped.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass, field
from typing import Any

KV_CACHE_FIELDS = ("kv_cache_quant_algo", "kv_cache_scheme")  # either names a quantised KV cache
# its scale tensors (``self_attn.k_proj.k_scale``; an FP8 attention's q and softmax-probability
# scales beside them), skipped
KV_SCALES = r"\.(q|k|v|kv|prob)_scale$"


@dataclass(frozen=True)
class QuantDeclaration:
    method: str | None = None  # "modelopt" | "fp8" | None
    algo: str | None = None  # "NVFP4" | "FP8" ... as declared
    exclude: tuple[str, ...] = ()
    weight_block_size: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    kv_cache: str | None = None  # a quantised KV cache as declared (not used: its scales are skipped)

    def excludes(self, module: str) -> bool:
        """Whether a pattern matches ``module`` or a module it is part of (``p`` or ``p.*``)."""
        names, globs = self._patterns
        name = module
        while name:  # the module, then each module it is part of
            if name in names:
                return True
            name = name.rpartition(".")[0]
        return globs is not None and globs.match(module) is not None

    @functools.cached_property
    def _patterns(self) -> tuple[frozenset[str], re.Pattern | None]:
        """The exclude patterns as a set of plain names and one regex of the shell patterns. The
        build asks the format of every expert projection (74k in Qwen3-Next), and Qwen's FP8
        releases list each layer's router by name: an fnmatch a pattern took seconds a build."""
        names = frozenset(p for p in self.exclude if not any(c in p for c in "*?["))
        globs = [fnmatch.translate(q) for p in self.exclude if p not in names for q in (p, p + ".*")]
        return names, re.compile("|".join(globs)) if globs else None

    def format_of(self, module: str) -> str:
        """The storage format the checkpoint uses for the linear ``module`` (its name without .weight)."""
        if self.method is None or self.excludes(module):
            return "bf16"
        if self.algo == "NVFP4":
            return "nvfp4"
        if self.method == "fp8" and self.weight_block_size:
            return "fp8_block"
        raise ValueError(f"unsupported quantisation declaration: method {self.method!r}, algo {self.algo!r}")


def _kv_cache(q: dict) -> str | None:
    """The KV-cache quantisation a declaration names, as text (None: none)."""
    return next((f"{key}={q[key]!r}" for key in KV_CACHE_FIELDS if q.get(key) is not None), None)


def parse_declaration(quantization_config: dict | None, hf_quant_config: dict | None) -> QuantDeclaration:
    if hf_quant_config:
        q = hf_quant_config.get("quantization", hf_quant_config)
        kv = _kv_cache(q) or _kv_cache(quantization_config or {})  # either file may name the KV cache
        return QuantDeclaration(
            "modelopt",
            q.get("quant_algo"),
            tuple(q.get("exclude_modules") or ()),
            None,
            dict(hf_quant_config),
            kv,
        )
    qc = quantization_config or {}
    method = qc.get("quant_method")
    if method is None:
        return QuantDeclaration()
    if method == "modelopt":
        return QuantDeclaration(
            "modelopt", qc.get("quant_algo"), tuple(qc.get("ignore") or ()), None, dict(qc), _kv_cache(qc)
        )
    if method == "fp8":
        block = tuple(qc.get("weight_block_size") or ())
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore") or ())
        return QuantDeclaration("fp8", "FP8", ignore, block or None, dict(qc), _kv_cache(qc))
    raise ValueError(
        f"config field quantization_config.quant_method: {method!r} is not supported (known: modelopt, fp8)"
    )
