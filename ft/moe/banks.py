"""Expert banks: the routed experts of one MoE layer, this rank's slice of the intermediate axis.

A bf16 bank stores ``w13 [E, 2·I/P, H]`` (gate rows then up rows) and ``w2 [E, H, I/P]``. It loads
the Hugging Face hub layout, ``experts.{e}.gate_proj/up_proj/down_proj.weight``, reading only
this rank's rows of gate/up and columns of down.
"""

from __future__ import annotations

import torch
from torch import nn

from ft.distributed import get_tp_info
from ft.layers.loading import load_slice, new_param
from ft.models.checkpoint import CheckpointTensor
from ft.moe.kernels.torch_ref import fused_moe_ref
from ft.utils import div_even

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class BF16ExpertBank(nn.Module):
    format = "bf16"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = get_tp_info()
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts,
            hidden_size,
            intermediate_size,
        )
        self.local_inter = div_even(intermediate_size, self.tp.size, "moe_intermediate_size over tp ranks")
        self.w13 = new_param(num_experts, 2 * self.local_inter, hidden_size, loader=self._load)
        self.w2 = new_param(num_experts, hidden_size, self.local_inter, loader=self._load)
        self.w13.checkpoint_parts = [
            (f"{e}.{p}.weight", (e, i)) for e in range(num_experts) for i, p in enumerate(PROJECTIONS[:2])
        ]
        self.w2.checkpoint_parts = [(f"{e}.down_proj.weight", (e, 2)) for e in range(num_experts)]

    def _load(self, param: torch.Tensor, ckpt: CheckpointTensor, shard_id: tuple[int, int]) -> None:
        e, proj = shard_id
        inter, hidden, local = self.intermediate_size, self.hidden_size, self.local_inter
        start = self.tp.rank * local
        if proj == 2:
            load_slice(
                param[e],
                ckpt,
                global_shape=(hidden, inter),
                dim=1,
                src_start=start,
                dst_start=0,
                length=local,
            )
        else:
            load_slice(
                param[e],
                ckpt,
                global_shape=(inter, hidden),
                dim=0,
                src_start=start,
                dst_start=proj * local,
                length=local,
            )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts for x [T, H]."""
        return fused_moe_ref(x, self.w13, self.w2, weights, ids)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.w13, self.w2))
