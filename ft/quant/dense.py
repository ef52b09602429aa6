"""Which format a rank builds and loads for each dense projection (and which checkpoint modules
load dequantised), decided in one place.

``dense_quant_mode`` turns the checkpoint's quantisation declaration into the format a family
with block-FP8 twins (qwen4_exp) builds for one dense linear module (``bf16``, meaning
unquantised float, or ``fp8_block``) and refuses, at start-up and naming the module, what cannot
run: a block-FP8 projection whose on-disk parts disagree, a malformed block size.
``quantize_dense_linears`` swaps in those twins, so the modules built and the tensors loaded can
never disagree. Everything else a checkpoint stores quantised loads into float layers through
``ft.quant.dequantized``, each such checkpoint module noted on ``model.dequantized`` here: NVFP4
dense modules in every family, block-FP8 ones in the families without twins
(``dequantize_dense``), block-FP8 routed experts (``dequantize_experts``: NVFP4 experts the bank
reads as they are).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ft.distributed import try_get_tp_info
from ft.layers.embedding import ParallelLMHead
from ft.layers.linear import ColumnParallelLinear, Part, ReplicatedLinear, RowParallelLinear
from ft.moe.banks import PROJECTIONS
from ft.moe.block import SparseMoeBlock
from ft.moe.router import TopKRouter
from ft.quant.declaration import QuantDeclaration
from ft.quant.dequantized import Dequantize
from ft.quant.fp8_block import Fp8BlockColumnParallelLinear, Fp8BlockRowParallelLinear

SWAPPABLE = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)


def checkpoint_names(module: str, parts: Sequence[str] = ()) -> list[str]:
    """The checkpoint modules that load linear ``module``: its ``parts`` when a fused module's
    parts are stored apart (``q_proj, k_proj, v_proj`` for ``qkv_proj``), else itself."""
    parent = module.rpartition(".")[0]
    return [f"{parent}.{p}".lstrip(".") for p in parts] or [module]


def dense_quant_mode(decl: QuantDeclaration, module: str, parts: Sequence[str] = ()) -> str:
    """The format rank r of the current TP group builds for linear ``module`` in a family with
    block-FP8 twins (qwen4_exp): ``fp8_block`` or ``bf16`` (unquantised float; NVFP4 parts are
    dequantised into it as they load, ``ft.quant.dequantized``).

    A block-FP8 module's parts must all be block-FP8. Works without an engine: outside a TP
    context it answers for one rank. Every TP split of a block-FP8 weight can run
    (``Fp8BlockLinear`` slices its scales per row), so TP only names the failing case.
    """
    where = _where(module)
    names = checkpoint_names(module, parts)
    formats = sorted({decl.format_of(n) for n in names})
    if "fp8_block" not in formats:
        return "bf16"
    if len(formats) > 1:
        raise ValueError(f"{where}: its parts {names} are stored as {formats}; block-FP8 needs them all")
    fp8_block_size(decl, where)
    return "fp8_block"


def _where(module: str) -> str:
    tp = try_get_tp_info()
    return f"{module} (tp_size {1 if tp is None else tp.size})"


def fp8_block_size(decl: QuantDeclaration, where: str) -> tuple[int, int]:
    block = decl.weight_block_size
    if block is None or len(block) != 2 or min(block) < 1:
        raise ValueError(f"{where}: fp8 weight_block_size {block} must be two positive sizes")
    return (int(block[0]), int(block[1]))


def fp8_twin(module: nn.Module, block: Sequence[int]) -> nn.Module:
    bias = module.bias is not None
    if isinstance(module, RowParallelLinear):
        return Fp8BlockRowParallelLinear(module.input_size, module.output_size, block, bias)
    if isinstance(module, ColumnParallelLinear):
        return Fp8BlockColumnParallelLinear(module.weight.shape[1], module.parts, block, bias)
    out, inp = module.weight.shape  # replicated: one part that every rank keeps whole
    return Fp8BlockColumnParallelLinear(inp, [Part(out, out, 0)], block, bias)


def dense_linears(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(name, module, checkpoint parts) of every dense linear, router and lm_head of ``model``."""
    packed = getattr(model, "packed_modules", {})
    return [
        (name, module, packed.get(name.rpartition(".")[2], ()))
        for name, module in model.named_modules()
        if isinstance(module, (*SWAPPABLE, TopKRouter, ParallelLMHead))
    ]


def note_dequantized(
    model: nn.Module, decl: QuantDeclaration, modules: list[str], formats: Sequence[str]
) -> None:
    """Note on ``model.dequantized`` each checkpoint module of ``modules`` the declaration stores
    in one of ``formats``, for the loader to hand its layer the float dequantisation."""
    noted = dict(getattr(model, "dequantized", {}))
    how: dict[str, Dequantize] = {}  # one a format: the block size is the declaration's
    for module in modules:
        fmt = decl.format_of(module)
        if fmt in formats:
            if fmt not in how:
                block = fp8_block_size(decl, _where(module)) if fmt == "fp8_block" else None
                how[fmt] = Dequantize(fmt, block)
            noted[module] = how[fmt]
    model.dequantized = noted


def quantize_dense_linears(model: nn.Module, decl: QuantDeclaration) -> None:
    """Swap each linear the checkpoint stores as block-FP8 for its FP8 twin (call inside the
    build); NVFP4 ones, and a block-FP8 router or lm_head (no twin), load dequantised."""
    if decl.method is None:
        return
    dense = dense_linears(model)
    note_dequantized(
        model, decl, [n for name, _, parts in dense for n in checkpoint_names(name, parts)], ["nvfp4"]
    )
    for name, module, parts in dense:
        fmt = dense_quant_mode(decl, name, parts)
        if fmt == "bf16":
            continue
        if not isinstance(module, SWAPPABLE):
            note_dequantized(model, decl, checkpoint_names(name, parts), ["fp8_block"])
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, fp8_twin(module, decl.weight_block_size))


def dequantize_dense(model: nn.Module, decl: QuantDeclaration) -> None:
    """For a family without block-FP8 twins (its fused loaders reorder rows a twin would not):
    every dense linear, router and lm_head the checkpoint stores as NVFP4 or block-FP8 loads
    dequantised into its float layer, part by part."""
    if decl.method is None:
        return
    names = [n for name, _, parts in dense_linears(model) for n in checkpoint_names(name, parts)]
    note_dequantized(model, decl, names, ["nvfp4", "fp8_block"])


def dequantize_experts(model: nn.Module, decl: QuantDeclaration) -> None:
    """Routed experts the checkpoint stores as block-FP8 (Qwen's FP8 releases) load dequantised
    into their bank (bf16, or NVFP4 quantised at load); NVFP4 ones the bank reads as they are."""
    if decl.method != "fp8":  # only block-FP8 declarations store block-FP8 experts
        return
    experts = [
        f"{name}.experts.{e}.{proj}"
        for name, m in model.named_modules()
        if isinstance(m, SparseMoeBlock)
        for e in range(m.experts.num_experts)
        for proj in PROJECTIONS
    ]
    note_dequantized(model, decl, experts, ["fp8_block"])
