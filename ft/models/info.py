"""What a model costs, without reading a weight: the model is built on the meta device for a
simulated rank, and its parameters are counted by kind (dense / experts / embeddings). Expert
banks are sized in their storage format (NVFP4 packed: ~9/32 of bf16, scales included), and each
tp size also shows what one rank's experts would take in bf16 and in NVFP4."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.config import DTYPES
from ft.distributed import TPInfo, tp_context
from ft.models.config import ModelConfig


@dataclass(frozen=True)
class RankFootprint:
    tp_size: int
    rank: int
    params: dict[str, int]  # kind -> parameters on this rank
    bytes: dict[str, int]  # kind -> bytes on this rank
    shapes: dict[str, tuple[int, ...]]  # parameter name -> local shape (first layers of each type)
    dequantized: dict[tuple[str, str], int]  # (kind, checkpoint format) -> modules loaded as float

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def param_kind(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"
    return "dense"


def footprint(
    mc: ModelConfig, tp_size: int, rank: int = 0, dtype: torch.dtype | None = None
) -> RankFootprint:
    from ft.engine.build import build_model

    dtype = dtype or DTYPES.get(mc.dtype, torch.bfloat16)
    model = build_model(mc, TPInfo(rank, tp_size), "meta", dtype)
    params: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    show = {f"model.layers.{i}." for i in (mc.attention_layers[:1] + mc.linear_layers[:1])}
    for name, p in model.named_parameters():
        kind = param_kind(name)
        params[kind] = params.get(kind, 0) + getattr(p, "logical_numel", p.numel())  # packed: unpacked count
        nbytes[kind] = nbytes.get(kind, 0) + p.numel() * p.element_size()
        if not name.startswith("model.layers.") or any(name.startswith(s) for s in show):
            shapes[name] = tuple(p.shape)
    dequantized: dict[tuple[str, str], int] = {}
    for module, how in getattr(model, "dequantized", {}).items():
        key = (param_kind(f"{module}.weight"), how.format)
        dequantized[key] = dequantized.get(key, 0) + 1
    return RankFootprint(tp_size, rank, params, nbytes, shapes, dequantized)


def expert_bytes(mc: ModelConfig, tp_size: int, fmt: str) -> int:
    """One rank's routed-expert bytes over all MoE layers if stored as ``fmt`` (one bank on meta):
    loaded from the checkpoint's own format if it is ``fmt`` (a ModelOpt bank keeps its activation
    scales), else quantised at load from bf16 (none)."""
    from ft.moe.block import BANKS

    first = mc.mlp_types.index("moe") if "moe" in mc.mlp_types else 0
    stored = mc.quantization.format_of(f"model.layers.{first}.mlp.experts.0.gate_proj")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a bf16 bank's dtype
    try:
        with tp_context(TPInfo(0, tp_size)), torch.device("meta"):
            source = fmt if stored == fmt else "bf16"
            bank = BANKS[fmt](mc.num_experts, mc.hidden_size, mc.moe_intermediate_size, source)
    finally:
        torch.set_default_dtype(previous)
    return bank.weight_bytes() * mc.mlp_types.count("moe")


def _expert_formats_line(mc: ModelConfig, tp_size: int) -> str:
    gib = 1024**3
    sizes = []
    for fmt in ("bf16", "nvfp4"):
        try:
            sizes.append(f"{fmt} {expert_bytes(mc, tp_size, fmt) / gib:8.3f} GiB")
        except ValueError as e:  # e.g. I/P not a multiple of NVFP4's 16-wide blocks
            sizes.append(f"{fmt} n/a ({e})")
    return f"  experts per rank: {', '.join(sizes)}; stored as {mc.expert_format}"


def format_info(mc: ModelConfig, tp_sizes: list[int]) -> str:
    gib = 1024**3
    full = footprint(mc, 1)
    lines = [f"model_type: {mc.model_type}"]
    lines += [f"  {k}: {v}" for k, v in mc.summary().items() if k != "model_type"]
    lines.append("parameters (whole model):")
    for kind in ("dense", "experts", "embeddings"):
        lines.append(f"  {kind:<11} {full.params.get(kind, 0):>16,}")
    lines.append(f"  {'total':<11} {sum(full.params.values()):>16,}")
    if full.dequantized:  # stored quantised, held in float (ft.quant.dequantized): the bytes below
        what = {"experts": "expert projections", "dense": "dense modules", "embeddings": "lm_head"}
        to = {"experts": "NVFP4"} if mc.expert_format == "nvfp4" else {}  # quantised again at load
        held = ", ".join(
            f"{n:,} {what[kind]} {fmt} -> {to.get(kind, mc.dtype)}"
            for (kind, fmt), n in sorted(full.dequantized.items())
        )
        lines.append(f"checkpoint: {held}, dequantised as they load")
    for tp in tp_sizes:
        ranks = [footprint(mc, tp, r) for r in range(tp)]
        lines.append(f"tp_size {tp}: weight bytes per rank")
        for fp in ranks:
            parts = "  ".join(
                f"{k} {fp.bytes.get(k, 0) / gib:8.3f} GiB" for k in ("dense", "experts", "embeddings")
            )
            lines.append(
                f"  rank {fp.rank}: {parts}  total {fp.total_bytes / gib:8.3f} GiB ({fp.total_bytes:,} B)"
            )
        if "moe" in mc.mlp_types:
            lines.append(_expert_formats_line(mc, tp))
        lines.append(f"tp_size {tp}: local shapes on rank 0")
        lines += [f"  {n:<58} {list(s)}" for n, s in ranks[0].shapes.items()]
    return "\n".join(lines)
