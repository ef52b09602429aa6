"""Hyper-connections (spec section 3): n residual streams mixed by small learned matrices.

The residual state of a token is ``X [n, H]``. Around each sublayer F:

    z    = rmsnorm(flatten(X))                 # stream-major, no weight, fp32
    m    = fn @ z                               # [2n + n²]
    pre  = sigmoid(scale[0]·m[:n] + base[:n]) + eps
    post = 2·sigmoid(scale[1]·m[n:2n] + base[n:2n])
    C    = sinkhorn(scale[2]·m[2n:] + base[2n:])          # [n, n]
    X'[j] = post[j] · F(sum_i pre[i]·X[i]) + sum_i C[i, j]·X[i]

With ``hc_mult == 1`` the same interface is a plain pre-norm residual, ``h + F(h)``, with no
tensors. Everything here is replicated on every rank; the streams are kept in the model's dtype
and the coefficients are computed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ft.layers.loading import new_param
from ft.layers.norm import rms

Sublayer = Callable[[torch.Tensor], torch.Tensor]


def sinkhorn(a: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Near doubly-stochastic P from logits a [..., n, n]; the spec's ``P.sum(0)`` sums over i."""
    p = torch.softmax(a, dim=-1) + eps
    p = p / (p.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


class HyperConnection(nn.Module):
    def __init__(self, n: int, hidden_size: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = new_param(2 * n + n * n, n * hidden_size)
        self.base = new_param(2 * n + n * n)
        self.scale = new_param(3)

    def forward(self, X: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        """X [T, n, H] -> X' [T, n, H]."""
        t, n, _ = X.shape
        z = rms(X.reshape(t, -1), self.norm_eps)  # [T, nH] fp32
        m = F.linear(z, self.fn.float())  # [T, 2n + n²]
        s, b = self.scale.float(), self.base.float()
        pre = torch.sigmoid(s[0] * m[:, :n] + b[:n]) + self.eps  # [T, n]
        post = 2.0 * torch.sigmoid(s[1] * m[:, n : 2 * n] + b[n : 2 * n])  # [T, n]
        c = sinkhorn(s[2] * m[:, 2 * n :].view(t, n, n) + b[2 * n :].view(n, n), self.iters, self.eps)
        xf = X.float()
        y = sublayer(torch.einsum("ti,tih->th", pre, xf).to(X.dtype)).float()  # [T, H]
        return (post[:, :, None] * y[:, None, :] + torch.einsum("tij,tih->tjh", c, xf)).to(X.dtype)


class PlainResidual(nn.Module):
    """``hc_mult == 1``: one stream, ``h + F(h)``."""

    def forward(self, X: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return X + sublayer(X[:, 0])[:, None]


class HyperHead(nn.Module):
    """Collapses the streams after the last layer: ``x = sum_i pre_head[i]·X[i]``."""

    def __init__(self, n: int, hidden_size: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = new_param(n, n * hidden_size)
        self.base = new_param(n)
        self.scale = new_param(1)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        z = rms(X.reshape(X.shape[0], -1), self.norm_eps)
        pre = torch.sigmoid(self.scale.float()[0] * F.linear(z, self.fn.float()) + self.base.float())
        return torch.einsum("ti,tih->th", pre + self.eps, X.float()).to(X.dtype)


def residual(n: int, hidden_size: int, iters: int, eps: float, norm_eps: float) -> nn.Module:
    return HyperConnection(n, hidden_size, iters, eps, norm_eps) if n > 1 else PlainResidual()
