"""Which format a rank builds and loads for each dense projection, decided in one place.

``dense_quant_mode`` turns the checkpoint's quantisation declaration into the format of one
dense linear module (``bf16``, meaning unquantised float, or ``fp8_block``) and refuses, at
start-up and naming the module, what cannot run: a dense format we have no layer for (NVFP4
dense projections), a fused projection whose on-disk parts disagree, a malformed block size.
``quantize_dense_linears`` asks it for every linear of a freshly built model and swaps in the
block-FP8 twin where the checkpoint holds FP8, so the modules built and the tensors loaded can
never disagree; ``require_bf16_dense`` is the check of a family that has no FP8 twins. Routed
experts are not dense: their bank format is ``ModelConfig.expert_format``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

from ft.distributed import try_get_tp_info
from ft.layers.embedding import ParallelLMHead
from ft.layers.linear import ColumnParallelLinear, Part, ReplicatedLinear, RowParallelLinear
from ft.moe.router import TopKRouter
from ft.quant.declaration import QuantDeclaration
from ft.quant.fp8_block import Fp8BlockColumnParallelLinear, Fp8BlockRowParallelLinear

DENSE_FORMATS = ("bf16", "fp8_block")
SWAPPABLE = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)


def dense_quant_mode(decl: QuantDeclaration, module: str, parts: Sequence[str] = ()) -> str:
    """The format rank r of the current TP group builds and loads for linear ``module``.

    ``parts`` are the checkpoint names of a fused module's parts when they are stored apart
    (``q_proj, k_proj, v_proj`` for ``qkv_proj``); they must all share one format. Works without
    an engine: outside a TP context it answers for one rank. Every TP split of a block-FP8 weight
    can run (``Fp8BlockLinear`` slices its scales per row), so TP only names the failing case.
    """
    tp = try_get_tp_info()
    where = f"{module} (tp_size {1 if tp is None else tp.size})"
    parent = module.rpartition(".")[0]
    names = [f"{parent}.{p}".lstrip(".") for p in parts] or [module]
    formats = sorted({decl.format_of(n) for n in names})
    if len(formats) > 1:
        raise ValueError(f"{where}: its parts {names} are stored as {formats}; a fused projection needs one")
    fmt = formats[0]
    if fmt not in DENSE_FORMATS:
        raise ValueError(
            f"{where}: dense {fmt} projections cannot run (known: {', '.join(DENSE_FORMATS)}); "
            "list the module in the quantisation declaration's ignore patterns"
        )
    block = decl.weight_block_size
    if fmt == "fp8_block" and (block is None or len(block) != 2 or min(block) < 1):
        raise ValueError(f"{where}: fp8 weight_block_size {block} must be two positive sizes")
    return fmt


def fp8_twin(module: nn.Module, block: Sequence[int]) -> nn.Module:
    bias = module.bias is not None
    if isinstance(module, RowParallelLinear):
        return Fp8BlockRowParallelLinear(module.input_size, module.output_size, block, bias)
    if isinstance(module, ColumnParallelLinear):
        return Fp8BlockColumnParallelLinear(module.weight.shape[1], module.parts, block, bias)
    out, inp = module.weight.shape  # replicated: one part that every rank keeps whole
    return Fp8BlockColumnParallelLinear(inp, [Part(out, out, 0)], block, bias)


def dense_formats(model: nn.Module, decl: QuantDeclaration) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, format) of every dense linear, router and lm_head of ``model``."""
    packed = getattr(model, "packed_modules", {})
    for name, module in list(model.named_modules()):
        if isinstance(module, (*SWAPPABLE, TopKRouter, ParallelLMHead)):
            yield name, module, dense_quant_mode(decl, name, packed.get(name.rpartition(".")[2], ()))


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


def require_bf16_dense(model: nn.Module, decl: QuantDeclaration) -> None:
    """For a family with no quantised dense layers: refuse, by name, a module declared quantised
    (else its scales would surface as unexpected tensors, its codes as a wrong shape)."""
    if decl.method is None:
        return
    for name, _, fmt in dense_formats(model, decl):
        if fmt != "bf16":
            raise ValueError(
                f"{name}: the checkpoint stores it as {fmt}, but {type(model).__name__} runs its dense "
                "projections in bf16 only; list it in the quantisation declaration's ignore patterns"
            )
