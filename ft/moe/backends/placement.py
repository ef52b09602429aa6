"""Where each routed expert of a layer is written when the weights load: a host store row, or,
in a lean store, a device cache slot.

Normally every expert has a row in the host store and the GPU cache holds copies of some. When
the host cannot hold every expert (full Qwen3-Next-80B-A3B in bf16: 155 GB of experts, 128 GiB
of RAM beside one H200) while the GPU could hold most of them, the store is *lean*:

    experts [0, R)   static: only in cache slots [0, R) of their layer, for the whole run, never
                     evicted and never copied, always a hit (``SlotMap(static=R)``)
    experts [R, E)   in host store rows e - R, cached in the S - R dynamic slots as usual

An expert that never leaves the GPU needs no host copy. The static experts are the first R ids:
before any routing is seen one choice is as good as another. A profile-driven choice (the most
used experts) would replace the identity by a permutation, here, in the slot map and in the
store rows. R is the smallest that lets the host hold the rest, so that the dynamic slots, which
follow the routing, get whatever GPU memory is left (``sizing.py``).

Loading writes each expert once, where it lives. Every expert tensor of a bank (w13, w2, ...)
becomes a parameter marked with a ``PlacedTensor``: its spans of expert rows, and the banks'
loaders (``ExpertBank.rows``) and dummy initialisation (``PlacedTensor.write``) go through it.
Without static experts the parameter is the host view itself, as it always was; with them it is
left on ``meta`` (it has no single home), so nothing can read it by mistake.
"""

from __future__ import annotations

import torch
from torch import nn

from ft.moe.backends.expert_cache import ExpertCache
from ft.moe.backends.host_store import HostStore


class PlacedTensor:
    """One ``[E, *shape]`` expert tensor of a bank as spans of expert rows, in expert order."""

    def __init__(self, spans: list[tuple[int, torch.Tensor]]) -> None:
        self.spans = spans  # (first expert, [n, *shape] view where experts first.. first + n - 1 live)

    def row(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``[*shape]`` view, wherever it lives."""
        for first, view in reversed(self.spans):
            if e >= first:
                return view[e - first]
        raise IndexError(f"expert {e} is in no span")

    def write(self, full: torch.Tensor) -> None:
        """Copy ``full`` ``[E, *shape]`` (on any device) to where its experts live."""
        for first, view in self.spans:
            view.copy_(full[first : first + len(view)])


def place(bank: nn.Module, store: HostStore, cache: ExpertCache | None = None) -> None:
    """Point ``bank``'s expert tensors at their homes: static experts (``store.static`` of them)
    in ``cache``'s first slots, the others in ``store``. Keeps each parameter's loader and marks."""
    r = store.static
    assert (cache is not None) == (r > 0), "static experts need their layer's cache, and only they do"
    for name, host in store.tensors.items():
        old = getattr(bank, name)
        assert (tuple(old.shape), old.dtype) == ((store.num_experts, *host.shape[1:]), host.dtype), (
            f"bank {name} {tuple(old.shape)} {old.dtype} does not match its host view "
            f"{tuple(host.shape)} {host.dtype}"
        )
        spans = [(r, host)] if r == 0 else [(0, cache.tensors[name][:r]), (r, host)]
        new = nn.Parameter(host if r == 0 else old.data, requires_grad=False)
        new.__dict__.update(old.__dict__)  # weight_loader, checkpoint_parts, logical_numel
        new.placed = PlacedTensor(spans)
        new.dequantize_on = bank.device  # a quantised checkpoint's experts are dequantised there
        setattr(bank, name, new)


def placed(p: torch.Tensor) -> bool:
    """A bank expert tensor whose experts live in a host store or cache slots, not in the tensor's
    own device memory (not counted as model weights)."""
    return getattr(p, "placed", None) is not None
