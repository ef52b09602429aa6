"""``Into``: a MoE kernel call whose tokens are rows of a larger batch and whose terms go into rows
of another tensor (the streamed offload layers' calls, ``ft.moe.backends.pairs.Terms``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Into:
    """Where a kernel call reads its tokens and writes its terms when both are rows of larger
    tensors (a streamed layer's calls, ``pairs.Terms``): the call's token i is row ``tokens[i]``
    of x, and its pair i's term (routing weight applied, rounded once, k = 1) is written to row
    ``rows[i]`` of ``out`` [R, H] instead of being returned: no gather of the tokens before the
    call, no scatter of its terms after. Kernels (the MMA paths, ``torch_ref``'s) return ``out``."""

    tokens: torch.Tensor  # [P] int64
    out: torch.Tensor  # [R, H], x's dtype, rows contiguous
    rows: torch.Tensor  # [P] int64

    def check(self, x: torch.Tensor, ids: torch.Tensor, gemv: bool) -> None:
        p = len(ids)
        if gemv or ids.dim() != 2 or ids.shape[1] != 1:
            raise ValueError(
                f"a call into rows takes the MMA path with one expert a token, got ids {tuple(ids.shape)}"
            )
        if self.tokens.shape != (p,) or self.rows.shape != (p,):
            raise ValueError(
                f"{p} pairs, {tuple(self.tokens.shape)} token rows, {tuple(self.rows.shape)} out rows"
            )
        if self.out.shape[1:] != x.shape[1:] or self.out.dtype != x.dtype or self.out.stride(-1) != 1:
            raise ValueError(f"out {tuple(self.out.shape)} {self.out.dtype} does not take x's rows {x.dtype}")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.tokens]

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        return self.out.index_copy_(0, self.rows, y)
