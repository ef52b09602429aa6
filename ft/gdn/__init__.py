"""Gated DeltaNet backends: the causal depthwise conv and the gated delta rule over a varlen batch.

A backend has
- ``conv(x, weight, conv_state, batch) -> silu(causal_conv1d(x))`` with x [T, C], weight [C, Kc],
  reading and updating ``conv_state[slot]`` ([slots, C, Kc-1], the last Kc-1 inputs);
- ``delta_rule(q, k, v, g, beta, ssm_state, batch) -> o`` with q, k [T, Hk, dk], v [T, Hv, dv],
  g, beta [T, Hv]; it l2-normalises q and k, scales q by dk^-0.5, reads and updates
  ``ssm_state[slot]`` ([slots, Hv, dk, dv], fp32). Sequences with no context start from zeros;
- optionally ``gated_delta_rule(mixed, b, a, A_log, dt_bias, ssm_state, batch) -> o``: the same
  from the conv output [T, 2·Hk·dk + Hv·dv] and the raw gate inputs b, a [T, Hv], so the backend
  can fuse beta = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias) and the split into kernels.

"auto" picks flash-linear-attention (``fla``) on CUDA when it imports, the torch reference otherwise.
"""

from __future__ import annotations


def _fla():
    from ft.gdn.fla_backend import FlaGDN

    return FlaGDN()


def _torch():
    from ft.gdn.torch_ref import TorchGDN

    return TorchGDN()


BACKENDS = {"fla": _fla, "torch": _torch}


def get_gdn_backend(name: str, device_type: str):
    if name == "auto":
        if device_type == "cuda":
            try:
                return _fla()
            except ImportError as e:  # correct but slow: say so rather than run it unannounced
                print(
                    f"ft: flash-linear-attention does not import ({e}); Gated DeltaNet layers run the "
                    "torch reference on the GPU (a per-token loop, orders of magnitude slower)",
                    flush=True,
                )
        return _torch()
    if name not in BACKENDS:
        raise ValueError(f"unknown GDN backend {name!r} (known: auto, {', '.join(BACKENDS)})")
    return BACKENDS[name]()
