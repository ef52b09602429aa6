"""Prefetch: the next MoE layer's router applied to this layer's input predicts its experts.

Hidden states change little from one layer to the next (the residual stream carries them), so
the next router on this layer's MoE input picks most of the experts the next layer will pick.
``predict`` runs on the device (inside CUDA graphs too) right after this layer's routing;
``start`` runs on the host once the predictions are read back with the layer's own ids, and
inserts the predicted experts into the next layer's cache (evicting only unpinned dynamic slots),
copying them on the side stream while this layer computes. The next layer's lookups then hit.
A wrong prediction costs PCIe bandwidth and maybe a useful slot, never a wrong result: the
next layer still routes with its own router and fetches whatever is missing. A batch whose
predicted experts do not fit the next layer's dynamic slots (a prefill chunk) prefetches nothing.
"""

from __future__ import annotations

import numpy as np
import torch


class Prefetch:
    def __init__(self, next_gate, next_backend) -> None:
        self.gate, self.backend = next_gate, next_backend

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)[1]  # [T, k] the next layer's experts, were its input x

    def start(self, experts: np.ndarray, after: torch.cuda.Event | None = None) -> None:
        """Copy the next layer's predicted ``experts`` (distinct) into its slots, where they fit."""
        nxt = self.backend
        # A prefill chunk predicts about every expert: inserting them would only evict others the
        # next layer's stream needs (twice the bytes over PCIe) and flush the decode working set.
        if nxt.map.fits(experts):
            nxt.copy_in(nxt.map.prefetch(experts), after=after)
