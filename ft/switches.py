"""The kernel switches in one table: module-level values that pick a kernel variant, each with the
environment variable that sets it for a process and the tensor-parallel ranks it spawns.

A variant lands behind a switch, off, until a GPU run times it and its GPU tests pass
(docs/architecture.md); then it is turned on. ``ft bench offline`` prints the values it ran with,
so a figure in docs/benchmarks.md says which variants made it, and
``tests/gpu/decode_variants.py`` times the ones still off. The modules are imported only when
asked (they need triton); a module that cannot be imported is left out.
"""

from __future__ import annotations

import importlib

# (module, attribute, environment variable)
SWITCHES: tuple[tuple[str, str, str], ...] = (
    ("ft.layers.pdl", "ENABLED", "FT_PDL"),
    ("ft.layers.pdl", "EARLY", "FT_PDL"),
    ("ft.moe.kernels.triton_moe_gemv", "SHARED_AS_PAIR", "FT_SHARED_AS_PAIR"),
    ("ft.gdn.triton_conv", "DECODE_ONE_LAUNCH", "FT_CONV_DECODE_ONE_LAUNCH"),
    ("ft.gdn.triton_conv_proj", "CONV_IN_PROJ", "FT_GDN_CONV_IN_PROJ"),
    ("ft.moe.kernels.triton_moe_gemv", "PIPELINE", "FT_MOE_GEMV_PIPELINE"),
    ("ft.moe.kernels.triton_moe_gemv", "FP4_PLANES", "FT_MOE_GEMV_FP4_PLANES"),
    ("ft.moe.kernels.triton_moe_gemv", "FP4_DOWN_PLANES", "FT_MOE_GEMV_FP4_DOWN_PLANES"),
    ("ft.moe.kernels.triton_moe_gemv", "FP4_INT_DOT", "FT_MOE_GEMV_FP4_INT_DOT"),
    ("ft.moe.kernels.triton_moe_gemv", "HOST_TILES", "FT_MOE_GEMV_HOST_TILES"),
    ("ft.layers.triton_gemv", "SPLIT_K", "FT_GEMV_SPLIT_K"),
    ("ft.moe.kernels.triton_router_gemv", "FUSED_ROUTER", "FT_FUSED_ROUTER"),
    ("ft.moe.kernels.triton_router", "KEYS32", "FT_ROUTER_KEYS32"),
    ("ft.attention.triton_paged", "FUSED_DECODE", "FT_FUSED_ATTN_DECODE"),
    ("ft.attention.triton_paged", "GLUON_EXTEND", "FT_ATTN_GLUON_EXTEND"),
    ("ft.attention.gluon_extend_ws", "WS", "FT_ATTN_GLUON_EXTEND_WS"),
    ("ft.attention.triton_paged", "MAX_SPLITS", "FT_ATTN_MAX_SPLITS"),  # an integer
    ("ft.moe.kernels.triton_w4a16", "LUT", "FT_W4A16_LUT"),
    ("ft.moe.kernels.triton_w4a16", "GLUON", "FT_W4A16_GLUON"),
    ("ft.distributed", "SYMM_ALL_REDUCE", "FT_SYMM_ALL_REDUCE"),
    ("ft.moe.backends.host_reads", "ENABLED", "FT_MOE_HOST_READS"),
    ("ft.moe.backends.host_reads", "DEFERRED", "FT_MOE_HOST_READS_DEFERRED"),
    ("ft.moe.backends.host_reads", "FUSED_ROUTE", "FT_MOE_HOST_READS_FUSED_ROUTE"),
    ("ft.moe.backends.host_stage", "STAGE", "FT_MOE_HOST_STAGE"),
    ("ft.moe.backends.host_stage", "NVFP4_STAGE", "FT_MOE_HOST_STAGE"),  # NVFP4 banks' own
    ("ft.moe.backends.host_prefetch", "ROWS", "FT_MOE_HOST_PREFETCH"),  # on: rows > 0
    ("ft.moe.backends.host_prefetch", "DOWN_ONLY", "FT_MOE_HOST_PREFETCH_DOWN"),
    ("ft.moe.backends.host_prefetch", "NVFP4_ROWS", "FT_MOE_HOST_PREFETCH"),  # NVFP4 banks' own
    ("ft.moe.backends.host_prefetch", "NVFP4_DOWN_ONLY", "FT_MOE_HOST_PREFETCH_DOWN"),
    ("ft.moe.backends.pairs", "DEVICE_PAIRS", "FT_MOE_DEVICE_PAIRS"),
    ("ft.moe.backends.pairs", "DIRECT_TERMS", "FT_MOE_DIRECT_TERMS"),
    ("ft.moe.backends.transfer", "MEMCPY", "FT_MOE_MEMCPY"),
    ("ft.moe.backends.streaming", "HITS_AFTER_AHEAD", "FT_MOE_HITS_AFTER_AHEAD"),
    ("ft.moe.backends.staging", "PRESTAGE", "FT_MOE_PRESTAGE"),
    ("ft.moe.backends.host_route", "DEVICE_COUNTS_MIN_PAIRS", "FT_MOE_DEVICE_COUNTS_MIN_PAIRS"),  # an integer
    ("ft.engine.allocator", "EXPANDABLE", "FT_EXPANDABLE_SEGMENTS"),
)


def current() -> dict[str, bool | int]:
    """``module:attribute`` -> its value in this process (a boolean, or the integer of an integer
    switch such as ``host_prefetch.ROWS``), for the modules that import."""
    values = {}
    for module, attr, _ in SWITCHES:
        try:
            v = getattr(importlib.import_module(module), attr)
        except ImportError:  # no triton: the GPU kernels' modules do not import
            continue
        values[f"{module}:{attr}"] = v if isinstance(v, int) and not isinstance(v, bool) else bool(v)
    return values


def describe(values: dict[str, bool | int]) -> str:
    """One line: the switches that are on, as ``module.ATTRIBUTE`` (the module's last name), an
    integer one with its value."""
    on = []
    for key, v in values.items():
        if v:
            name = key.split(":")[0].rsplit(".", 1)[-1] + "." + key.split(":")[1]
            on.append(name if isinstance(v, bool) else f"{name}={v}")
    return "kernel switches on: " + (", ".join(on) if on else "none")
