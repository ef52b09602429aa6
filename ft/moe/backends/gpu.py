"""The resident backend: every routed expert of the layer lives in the bank, on the model's device.

This is what runs when the experts fit (``--moe-backend gpu``); it adds nothing to the kernel
call. The other backends are measured against it: same bank, same kernel, same outputs.
"""

from __future__ import annotations

import torch


class ResidentBackend:
    name = "gpu"

    def __call__(self, bank, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return bank.kernel(x, *bank.kernel_weights(), weights, ids)
