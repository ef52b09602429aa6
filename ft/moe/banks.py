"""Expert banks: the routed experts of one MoE layer, this rank's slice of the intermediate axis.

Every bank stacks gate and up rows as ``w13`` (gate rows then up rows) and down as ``w2``, and
splits them over tensor-parallel ranks along the intermediate axis I: rank r holds gate/up rows
and down columns ``[r·I/P, (r+1)·I/P)``. Formats:

- bf16 (here): ``w13 [E, 2·I/P, H]``, ``w2 [E, H, I/P]``.
- nvfp4 (``ft.moe.nvfp4_bank``): packed E2M1 codes, 16-wide fp8 scales and per-row fp32 globals.

Banks load the Hugging Face hub layout, ``experts.{e}.gate_proj/up_proj/down_proj.*``, reading
only this rank's rows of gate/up and columns of down, and run the kernel the selection table
picks once, at construction, for their format, device, activation dtype and TP size. Where the
weights live is not decided here: a bank is built on the model's device, unless the MoE backend
keeps experts in a host store (``ft.moe.backends``), which then places the ``expert_tensors``
(``placement.py``): each expert's rows are a view of host memory or of a GPU cache slot, and the
loaders below, reading them through ``expert``, fill that memory directly. ``kernel_weights`` takes
the tensors to run on, so a backend can hand the kernel its cache slots instead of the bank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ft.distributed import get_tp_info
from ft.layers.loading import load_slice, new_param
from ft.models.checkpoint import CheckpointTensor
from ft.moe.backends import bank_device
from ft.moe.kernels.select import kernel_spec, select_moe_kernel
from ft.utils import div_even

try:  # the Triton kernels, each beside its rule for handing a batch to the MoE GEMV
    from ft.moe.kernels import triton_moe, triton_w4a16

    GEMV_RULES = {triton_moe.fused_moe_triton: triton_moe, triton_w4a16.fused_moe_w4a16: triton_w4a16}
except ImportError:  # no triton (CPU-only installs): no kernel hands anything to the GEMV
    GEMV_RULES = {}

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# checkpoint formats a bank reads as float: bf16 itself, block-FP8 dequantised by the loader
# (``ft.quant.dequantized``)
FLOAT_SOURCES = ("bf16", "fp8_block")


def weight_parts(num_experts: int, suffix: str = "weight") -> tuple[list, list]:
    """``checkpoint_parts`` of w13 and w2: (name under the bank, (expert, projection))."""
    w13 = [(f"{e}.{p}.{suffix}", (e, i)) for e in range(num_experts) for i, p in enumerate(PROJECTIONS[:2])]
    w2 = [(f"{e}.down_proj.{suffix}", (e, 2)) for e in range(num_experts)]
    return w13, w2


class ExpertBank(nn.Module):
    """What every bank shares: sizes, this rank's intermediate range, the selected kernel.

    A subclass allocates ``w13``/``w2`` (and whatever else its format needs) inside
    ``allocating()``, then calls ``select_kernel``; ``kernel_weights`` hands the kernel its two
    operands. ``expert_tensors`` names the ``[E, ...]`` tensors that make up the experts (what a
    host store holds and a cache slot copies), in the order of their layout.
    """

    format: str
    expert_tensors: tuple[str, ...]

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = get_tp_info()
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts,
            hidden_size,
            intermediate_size,
        )
        self.local_inter = div_even(intermediate_size, self.tp.size, "moe_intermediate_size over tp ranks")
        self.inter_start = self.tp.rank * self.local_inter  # first intermediate index on this rank
        self.device = torch.get_default_device()  # where the model (and the kernel) runs

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Parameters made here go where the MoE backend wants them (``meta``: a host store's)."""
        with torch.device(bank_device() or self.device):
            yield

    def select_kernel(self) -> None:
        self.kernel_name, self.kernel = select_moe_kernel(
            self.format, self.device, self.tp.size, dtype=torch.get_default_dtype()
        )

    @property
    def graph_safe(self) -> bool:
        return kernel_spec(self.kernel_name).graph_safe

    def takes_gemv(self, tokens: int) -> bool:
        """Whether the kernel runs a batch of ``tokens`` tokens as the MoE GEMV
        (``triton_moe_gemv``), the one that also takes a shared pair and host-store rows: asks
        the kernel's module its own rule."""
        module = GEMV_RULES.get(self.kernel)
        return module is not None and module.takes_gemv(tokens, self.local_inter)

    @staticmethod
    def expert(param: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` of one of the expert tensors, where it lives (placed by an MoE backend)."""
        placed = getattr(param, "placed", None)
        return placed.row(e) if placed is not None else param.data[e]

    def rows(self, param: torch.Tensor, e: int, proj: int) -> torch.Tensor:
        """Expert ``e``'s gate (0) or up (1) rows of a w13-shaped tensor, or all of w2 (2)."""
        if proj == 2:
            return self.expert(param, e)
        return self.expert(param, e).narrow(0, proj * self.local_inter, self.local_inter)

    def expert_weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.expert_tensors}

    def kernel_weights(self, tensors: Mapping[str, torch.Tensor] | None = None) -> tuple:
        """The kernel's (w13, w2) from ``tensors`` (name -> [n, ...]; default: the bank's own)."""
        t = tensors if tensors is not None else self.expert_weights()
        return t["w13"], t["w2"]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts for x [T, H]."""
        return self.run(x, weights, ids)

    def run(
        self, x, weights, ids, tensors: Mapping[str, torch.Tensor] | None = None, shared=None, host=None,
        down=None,
    ):  # fmt: skip
        """The kernel on ``tensors`` (default: the bank's own; a backend passes its cache slots).
        With ``shared`` (gate_up, down, logit) the MoE GEMV also computes the block's shared
        expert, as one more pair of each token (``triton_moe_gemv.SHARED_AS_PAIR``). With
        ``host`` (a host store's tensors, laid out as ``tensors``) an id e < 0 is the host
        store's row -e - 1, read by the MoE GEMV in place (``host_reads.py``). ``down``: (ids
        of the down projections, a callable run between the two launches, or None), where the
        down kernel reads other rows than gate/up (a down-only prefetch: ``host_prefetch.py``)."""
        w13, w2 = self.kernel_weights(tensors)
        if shared is None and host is None:
            assert down is None, "other down rows are a host read's"
            return self.kernel(x, w13, w2, weights, ids, batch_experts=self.num_experts)  # a cache's too
        if host is not None and not x.is_cuda:  # no GPU to read it: both sides as one bank (tests)
            from ft.moe.backends.host_reads import as_one_bank

            assert shared is None, "a shared expert rides in the GPU's MoE GEMV only"
            down_ids = None if down is None else down[0]
            w13, w2, ids = as_one_bank((w13, w2), self.kernel_weights(host), ids, down_ids)
            return self.kernel(x, w13, w2, weights, ids)
        from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv  # a GPU path: triton is there

        host_weights = None if host is None else self.kernel_weights(host)
        return fused_moe_gemv(x, w13, w2, weights, ids, shared, host_weights, down)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class BF16ExpertBank(ExpertBank):
    format = "bf16"
    expert_tensors = ("w13", "w2")

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, checkpoint_format: str = "bf16"
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        if checkpoint_format not in FLOAT_SOURCES:
            raise ValueError(
                f"the checkpoint stores these experts as {checkpoint_format}; a bf16 expert bank "
                "cannot load them (the model's expert_format must match)"
            )
        with self.allocating():
            self.w13 = new_param(num_experts, 2 * self.local_inter, hidden_size, loader=self._load)
            self.w2 = new_param(num_experts, hidden_size, self.local_inter, loader=self._load)
        self.w13.checkpoint_parts, self.w2.checkpoint_parts = weight_parts(num_experts)
        self.select_kernel()

    def _load(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id: tuple[int, int]) -> None:
        e, proj = shard_id
        inter, hidden, local = self.intermediate_size, self.hidden_size, self.local_inter
        if proj == 2:
            shape, dim = (hidden, inter), 1
        else:
            shape, dim = (inter, hidden), 0
        load_slice(
            self.rows(param, e, proj),
            ckpt,
            global_shape=shape,
            dim=dim,
            src_start=self.inter_start,
            dst_start=0,
            length=local,
        )
