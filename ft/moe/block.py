"""The MoE sublayer: routed experts plus an optional sigmoid-gated shared expert, one reduce.

    y = sum_k p_k · expert_k(x) + sigmoid(shared_expert_gate · x) · shared_expert(x)

Both terms are this rank's partial sums over its intermediate shard, so they are added before a
single all-reduce. The gate logit comes out of the router's GEMM, whose weight carries
``shared_expert_gate`` as its last row (``SHARED_GATE_PACKING`` loads the checkpoint's two
tensors into it). The routed experts live in a bank of the model's ``expert_format`` (one format
for every layer); ``checkpoint_format`` says what the checkpoint stores for this layer's
experts, so an NVFP4 bank quantises bf16 experts while loading and a bf16 bank refuses NVFP4 ones.
Where the experts live is the block's ``backend`` (``ft.moe.backends``): resident in the bank
unless the engine attaches an offloading one; either way it returns the routed partial sum.
On a GPU the SwiGLU activation and the gated add of the shared expert are one Triton kernel
each (``ft.moe.kernels.triton_combine``), computed in fp32 and rounded once; with
``triton_moe_gemv.SHARED_AS_PAIR`` a decode-sized batch runs the shared expert inside the routed
experts' GEMV instead, as one more pair of each token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ft.distributed import all_reduce, get_tp_info
from ft.layers.linear import ColumnParallelLinear, RowParallelLinear, split_part
from ft.moe.backends.gpu import ResidentBackend
from ft.moe.banks import BF16ExpertBank
from ft.moe.nvfp4_bank import NVFP4ExpertBank
from ft.moe.router import TopKRouter

try:  # fused kernels instead of 2-3 elementwise ones each; used for tensors on a GPU
    from ft.moe.kernels import triton_moe_gemv
    from ft.moe.kernels.triton_combine import gated_add as fused_gated_add
    from ft.moe.kernels.triton_combine import silu_and_mul as fused_silu_and_mul
except ImportError:  # no triton (CPU-only installs)
    fused_gated_add = fused_silu_and_mul = triton_moe_gemv = None

BANKS = {"bf16": BF16ExpertBank, "nvfp4": NVFP4ExpertBank}

# A model whose MoE blocks have a shared expert adds this to its ``packed_modules``: the router's
# weight loads its expert rows from ``gate`` and its last row from ``shared_expert_gate``.
SHARED_GATE_PACKING = {"gate": ("gate", "shared_expert_gate")}


class GatedMLP(nn.Module):
    """SwiGLU MLP: gate_up column-parallel, down row-parallel. ``name`` is the config field of its
    size, for the error when the TP size cannot split it."""

    def __init__(self, hidden_size: int, intermediate_size: int, name: str = "intermediate_size") -> None:
        super().__init__()
        part = split_part(intermediate_size, get_tp_info(), f"{name} over tp ranks")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [], parts=(part, part))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # [T, 2I] gate then up
        if h.is_cuda and fused_silu_and_mul is not None:
            return fused_silu_and_mul(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(self._act(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(x))


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
        expert_format: str = "bf16",
        checkpoint_format: str = "bf16",
    ) -> None:
        super().__init__()
        self.tp = get_tp_info()
        self.gate = TopKRouter(
            hidden_size, num_experts, top_k, renormalize, shared_gate=shared_intermediate_size > 0
        )
        if expert_format not in BANKS:
            raise ValueError(f"expert format {expert_format!r} is not supported (known: {sorted(BANKS)})")
        self.experts = BANKS[expert_format](num_experts, hidden_size, intermediate_size, checkpoint_format)
        self.backend = ResidentBackend()  # a plain object, not a module: holds no parameters
        self.shared_expert = (
            GatedMLP(hidden_size, shared_intermediate_size, "shared_expert_intermediate_size")
            if shared_intermediate_size
            else None
        )

    def lookahead(self, residual: torch.Tensor, norm: nn.Module) -> None:
        """Before the layer's mixer: ``norm(residual)`` (the residual stream without the mixer's
        term) is a guess at this block's input, which a backend may route ahead of time
        (``host_prefetch.py``)."""
        ahead = getattr(self.backend, "lookahead", None)
        if ahead is not None:
            ahead(self, residual, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # shared_logit [T, 1] when there is a shared expert
        weights, ids, shared_logit = self.gate(x, blocks=self._int_blocks(x))
        if self._shared_as_pair(x):  # one pair more per token in the routed GEMV's two launches
            mlp = self.shared_expert
            shared = (mlp.gate_up_proj.weight, mlp.down_proj.weight, shared_logit)
            return all_reduce(self.backend(self.experts, x, weights, ids, shared), self.tp)
        y = self.backend(self.experts, x, weights, ids)
        if self.shared_expert is not None:
            y = gated_add(y, shared_logit, self.shared_expert.partial(x))
        return all_reduce(y, self.tp)

    def _int_blocks(self, x: torch.Tensor) -> bool:
        """Whether the router should make x's int16 blocks (``triton_moe_gemv.FP4_INT_DOT``: an
        NVFP4 bank's MoE GEMV takes its products as integer dot products of them)."""
        return (
            triton_moe_gemv is not None
            and triton_moe_gemv.FP4_INT_DOT
            and self.experts.format == "nvfp4"
            and x.is_cuda
            and self.experts.takes_gemv(len(x))
        )

    def _shared_as_pair(self, x: torch.Tensor) -> bool:
        """Whether the shared expert runs inside the routed experts' GEMV
        (``triton_moe_gemv.SHARED_AS_PAIR``): a batch the bank's Triton kernel hands its GEMV, on
        a GPU, a backend that takes it (resident and offload: the hybrid and CPU ones compute
        misses on the CPU), and a shared expert as wide as a routed one on this rank."""
        if triton_moe_gemv is None or not triton_moe_gemv.SHARED_AS_PAIR or self.shared_expert is None:
            return False
        bank, down = self.experts, self.shared_expert.down_proj.weight
        return (
            bank.takes_gemv(len(x))
            and x.is_cuda
            and getattr(self.backend, "shared_pair", False)
            and down.shape == (bank.hidden_size, bank.local_inter)
            and down.dtype == x.dtype
        )


def gated_add(y: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """y + sigmoid(gate_logit) · shared: y, shared [T, H], gate_logit [T, 1] (a strided view)."""
    if y.is_cuda and fused_gated_add is not None:
        return fused_gated_add(y, gate_logit, shared)
    return y + torch.sigmoid(gate_logit) * shared
