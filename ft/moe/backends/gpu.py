"""The resident backend: every routed expert of the layer lives in the bank, on the model's device.

This is what runs when the experts fit (``--moe-backend gpu``); it adds nothing to the kernel
call. The other backends are measured against it: same bank, same kernel, same outputs.
"""

from __future__ import annotations

import torch


class ResidentBackend:
    name = "gpu"
    shared_pair = True  # takes the block's shared expert as one more GEMV pair (``SparseMoeBlock``)

    def __call__(
        self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: tuple | None = None
    ) -> torch.Tensor:
        return bank.run(x, weights, ids, shared=shared)
