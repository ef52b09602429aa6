"""Which format a rank builds and loads for each dense projection, decided in one place.

``dense_quant_mode`` turns the checkpoint's quantisation declaration into the format of one
dense linear module (``bf16``, meaning unquantised float, or ``fp8_block``) and refuses, at
start-up and naming the module, what cannot run: a block-FP8 projection whose on-disk parts
disagree, a malformed block size. A module (or part) stored as NVFP4 is built in float and
loads dequantised (``ft.quant.nvfp4_dense``): ``dense_formats`` notes those for the loader.
``quantize_dense_linears`` asks it for every linear of a freshly built model and swaps in the
block-FP8 twin where the checkpoint holds FP8, so the modules built and the tensors loaded can
never disagree; ``require_float_dense`` is the check of a family that has no FP8 twins. Routed
experts are not dense: their bank format is ``ModelConfig.expert_format``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ft.distributed import try_get_tp_info
from ft.layers.embedding import ParallelLMHead
from ft.layers.linear import ColumnParallelLinear, Part, ReplicatedLinear, RowParallelLinear
from ft.moe.router import TopKRouter
from ft.quant.declaration import QuantDeclaration
from ft.quant.fp8_block import Fp8BlockColumnParallelLinear, Fp8BlockRowParallelLinear

SWAPPABLE = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)


def checkpoint_names(module: str, parts: Sequence[str] = ()) -> list[str]:
    """The checkpoint modules that load linear ``module``: its ``parts`` when a fused module's
    parts are stored apart (``q_proj, k_proj, v_proj`` for ``qkv_proj``), else itself."""
    parent = module.rpartition(".")[0]
    return [f"{parent}.{p}".lstrip(".") for p in parts] or [module]


def dense_quant_mode(decl: QuantDeclaration, module: str, parts: Sequence[str] = ()) -> str:
    """The format rank r of the current TP group builds for linear ``module``: ``fp8_block`` or
    ``bf16`` (unquantised float; NVFP4 parts are dequantised into it as they load,
    ``ft.quant.nvfp4_dense``).

    A block-FP8 module's parts must all be block-FP8. Works without an engine: outside a TP
    context it answers for one rank. Every TP split of a block-FP8 weight can run
    (``Fp8BlockLinear`` slices its scales per row), so TP only names the failing case.
    """
    tp = try_get_tp_info()
    where = f"{module} (tp_size {1 if tp is None else tp.size})"
    names = checkpoint_names(module, parts)
    formats = sorted({decl.format_of(n) for n in names})
    if "fp8_block" not in formats:
        return "bf16"
    if len(formats) > 1:
        raise ValueError(f"{where}: its parts {names} are stored as {formats}; block-FP8 needs them all")
    block = decl.weight_block_size
    if block is None or len(block) != 2 or min(block) < 1:
        raise ValueError(f"{where}: fp8 weight_block_size {block} must be two positive sizes")
    return "fp8_block"


def fp8_twin(module: nn.Module, block: Sequence[int]) -> nn.Module:
    bias = module.bias is not None
    if isinstance(module, RowParallelLinear):
        return Fp8BlockRowParallelLinear(module.input_size, module.output_size, block, bias)
    if isinstance(module, ColumnParallelLinear):
        return Fp8BlockColumnParallelLinear(module.weight.shape[1], module.parts, block, bias)
    out, inp = module.weight.shape  # replicated: one part that every rank keeps whole
    return Fp8BlockColumnParallelLinear(inp, [Part(out, out, 0)], block, bias)


def dense_formats(model: nn.Module, decl: QuantDeclaration) -> list[tuple[str, nn.Module, str]]:
    """(name, module, format) of every dense linear, router and lm_head of ``model``; notes the
    checkpoint modules stored as NVFP4 on ``model.nvfp4_dense``, for the loader to dequantise."""
    packed = getattr(model, "packed_modules", {})
    out, nvfp4 = [], set()
    for name, module in list(model.named_modules()):
        if isinstance(module, (*SWAPPABLE, TopKRouter, ParallelLMHead)):
            parts = packed.get(name.rpartition(".")[2], ())
            nvfp4.update(n for n in checkpoint_names(name, parts) if decl.format_of(n) == "nvfp4")
            out.append((name, module, dense_quant_mode(decl, name, parts)))
    model.nvfp4_dense = frozenset(nvfp4)
    return out


def quantize_dense_linears(model: nn.Module, decl: QuantDeclaration) -> None:
    """Swap each linear the checkpoint stores as block-FP8 for its FP8 twin (call inside the build)."""
    if decl.method is None:
        return
    for name, module, fmt in dense_formats(model, decl):
        if fmt == "bf16":
            continue
        if not isinstance(module, SWAPPABLE):
            raise ValueError(
                f"{name}: a {type(module).__name__} cannot be stored as {fmt}; "
                "list it in the quantisation declaration's ignore patterns"
            )
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, fp8_twin(module, decl.weight_block_size))


def require_float_dense(model: nn.Module, decl: QuantDeclaration) -> None:
    """For a family with no block-FP8 twins (its fused loaders reorder rows a twin would not):
    refuse, by name, a module declared block-FP8; NVFP4 ones load dequantised."""
    if decl.method is None:
        return
    for name, _, fmt in dense_formats(model, decl):
        if fmt != "bf16":
            raise ValueError(
                f"{name}: the checkpoint stores it as {fmt}, but {type(model).__name__} runs its dense "
                "projections in bf16 only; list it in the quantisation declaration's ignore patterns"
            )
