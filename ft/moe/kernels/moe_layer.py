"""A decode batch's MoE sublayer in one launch (``ROUTE``, off until timed): the router's GEMV and
top-k, the routed experts' gate/up and down and the shared expert as one more pair, where they were
two launches after the router's (``moe_gemv_chain``) and the router's own.

The launch is ``moe_gemv_chain``'s with the router's tiles first: ``triton_router_gemv``'s column
blocks by K splits (``router_tile``: the same partials, tickets and top-k), then the gate/up tiles,
then the down tiles. A routed pair's gate/up tile and every down tile wait until all router tiles
have finished (their routing, the gate logit, x's int16 blocks); the shared expert's gate/up tiles
read x alone and take the tickets right after the router's, so they run beside them. The router
keeps its own launch's K splits but steps through each at most 128 inputs at a time (the 80B's
router takes 256 in one step: compiled for sm_90 inside this kernel at one loop stage, that took
255 registers and spilled, 128 takes 72); a split's MMAs accumulate in the same order either way.

Same contract as ``TopKRouter`` then ``triton_moe_gemv.fused_moe_gemv`` with the shared pair: the
routing of the fused router and the chain's output. Not here: batches the fused router does not take
(``triton_router_gemv.takes_fused``), offloading backends (their routing goes to the host), tensor
parallelism's reduce (the caller's).
"""

from __future__ import annotations

import os

import torch
import triton

from ft.layers import triton_gemv
from ft.moe.kernels import triton_router, triton_router_gemv

# OFF until timed (tests/gpu/decode_variants.py ...:ROUTE); FT_MOE_LAYER_ROUTE=1 turns it on for a
# process and the ranks it spawns. Read at each call.
ROUTE = os.environ.get("FT_MOE_LAYER_ROUTE", "0") == "1"
BLOCK_K = 128  # the router's step inside the chain
ROUTER_COUNTERS = 8192  # where its tickets start (after the down tiles' per-(token, row block) ones)


def takes(x: torch.Tensor, router_w: torch.Tensor) -> bool:
    """Whether a decode batch's MoE sublayer may run as one launch: the switch on and a batch the
    fused router takes (the caller checks its experts: resident, the GEMV's, a shared pair)."""
    return ROUTE and triton_router_gemv.takes_fused(x, router_w)


def route(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, shared_gate: bool) -> tuple:
    """The router's part of the launch for x [T, H] over w [E (+ 1), H]: (weights [T, k] fp32, ids
    [T, k] int64, the gate logit [T, 1] or None: buffers the launch fills; the chain's ``route``)."""
    x, w, p, (logits, weights, ids, ws) = triton_router_gemv.operands(x, w, top_k, shared_gate)
    (t, h), n = x.shape, w.shape[0]
    e = n - shared_gate
    # the fused router's own splits (so its logits' partials), in steps of at most BLOCK_K
    p = p._replace(block_k=min(p.block_k, BLOCK_K), even_k=h % min(p.block_k, BLOCK_K) == 0)
    assert ROUTER_COUNTERS + p.blocks < triton_gemv.BLOCK_COUNTERS, f"N={n}: too many column blocks"
    tickets = triton_gemv.tickets(x.device)[ROUTER_COUNTERS:]
    args = dict(
        rw=w, logits=logits, rws=ws, rcounters=tickets, R_N=n, R_E=e, R_K_SPLIT=p.k_split, R_BLOCKS=p.blocks,
        R_SPLITS=p.splits,
        R_BLOCK_N=p.block_n, R_BLOCK_K=p.block_k, R_EVEN_K=p.even_k, T_P=triton.next_power_of_2(t),
        TOP_K_P=triton.next_power_of_2(top_k), E_P=triton.next_power_of_2(e), RENORMALIZE=renormalize,
        KEYS32=triton_router.keys32(x.dtype),
    )  # fmt: skip
    return weights, ids, logits[:, e:] if shared_gate else None, args


def fused_moe_layer(
    x: torch.Tensor, router_w: torch.Tensor, top_k: int, renormalize: bool, w13, w2, shared: tuple | None
) -> torch.Tensor:
    """x [T, H] -> this rank's MoE output [T, H] in one launch: routed by ``router_w`` (the shared
    gate's row last when ``shared`` = (gate_up [2I, H], down [H, I]) is given), as ``TopKRouter``
    then ``fused_moe_gemv``. Without the device check (the interpreter runs it)."""
    from ft.moe.kernels.triton_moe_gemv import launch_moe_gemv  # it imports the chain's modules

    weights, ids, logit, args = route(x, router_w, top_k, renormalize, shared is not None)
    pair = None if shared is None else (*shared, logit)
    return launch_moe_gemv(x, w13, w2, weights, ids, pair, route=args)
