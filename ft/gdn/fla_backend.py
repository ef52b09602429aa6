"""Gated DeltaNet on the GPU: flash-linear-attention's kernels behind the ``TorchGDN`` contract.

- ``conv``: our Triton causal conv1d (``triton_conv``), history read from and written to the
  ``conv_state`` slot pool in place;
- ``delta_rule``: fla's ``chunk_gated_delta_rule`` (varlen through ``cu_seqlens``) when any
  sequence brings more than ``RECURRENT_MAX_TOKENS`` tokens, ``fused_recurrent_gated_delta_rule``
  otherwise (varlen, or one token per sequence for pure decode). The model calls it only for
  longer sequences: ``gated_delta_rule`` below runs short ones itself.
  Initial states are gathered from ``ssm_state[state_slots]`` (zeros where ``context_lens == 0``),
  final states scattered back; q and k are l2-normalised inside fla and q is scaled by dk^-0.5.

fla keeps the state as ``[N, Hv, dk, dv]`` fp32, the same layout as our pool, so no transposes.
It is not a training path (no backward) and supports only what fla supports (dk, dv <= 256).

``gated_delta_rule`` takes the mixer's raw parts instead (conv output, b, a) and fuses around
fla: a decode step, or a batch of sequences of at most ``RECURRENT_MAX_TOKENS`` tokens (a
prefix-cache snapshot's tail, small chunks), is one kernel of ours
(``triton_decode.gdn_recurrent``: gates, l2norm and the in-place state update, no gather,
scatter or copies; fla's recurrent path is about nine launches and its wrapper); otherwise the
gates are one kernel (``gdn_gates``) and the rest is fla's chunked ``delta_rule``.
"""

from __future__ import annotations

import torch

from ft.forward_context import ForwardBatch
from ft.gdn.triton_conv import causal_conv1d_silu
from ft.gdn.triton_decode import gdn_gates, gdn_recurrent
from ft.utils import upload

CHUNK = 64  # tokens per chunk of fla's chunked gated delta rule (its default)
# Batches whose sequences are all this short run a recurrent kernel (tokens in order: ours from
# ``gated_delta_rule``, fla's fused one from ``delta_rule``) instead of the chunked one (~10
# launches and its chunk layout): the tail pass of a prefix-cache snapshot (at most a block) and
# small chunks. Not timed on the GPU yet.
RECURRENT_MAX_TOKENS = 16


def _is_decode(t: int, batch: ForwardBatch) -> bool:
    """One token per sequence, told from shapes alone so the decode path stays graph-capturable."""
    return t == batch.cu_seqlens.shape[0] - 1


class FlaGDN:
    name = "fla"
    graph_safe = True  # the decode path (one token per sequence) never syncs with the host
    # its decode conv is ``triton_conv``'s, which the mixer may run as the input projection's
    # epilogue instead (``triton_conv_proj``: the same arithmetic)
    folds_decode_conv = True

    def __init__(self) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices

        self._chunk = chunk_gated_delta_rule
        self._chunk_indices = prepare_chunk_indices
        self._recurrent = fused_recurrent_gated_delta_rule

    def conv(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch):
        max_q = 1 if _is_decode(x.shape[0], batch) else max(batch.query_lens_cpu)
        return causal_conv1d_silu(x, weight, conv_state, batch, max_q)

    def gated_delta_rule(
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """mixed [T, 2·Hk·dk + Hv·dv] (conv output), b and a [T, Hv] -> o [T, Hv, dv]: the gates
        beta = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias), then ``delta_rule``."""
        t = mixed.shape[0]
        if _is_decode(t, batch) or max(batch.query_lens_cpu) <= RECURRENT_MAX_TOKENS:
            return gdn_recurrent(mixed, b, a, A_log, dt_bias, ssm_state, batch)
        hv, dk, dv = ssm_state.shape[1:]
        key = (mixed.shape[1] - hv * dv) // 2
        q, k, v = mixed.split([key, key, hv * dv], dim=-1)
        g, beta = gdn_gates(b, a, A_log, dt_bias)
        qk = q.view(t, -1, dk), k.view(t, -1, dk)
        return self.delta_rule(*qk, v.view(t, hv, dv), g, beta, ssm_state, batch)

    def _cu_seqlens(self, batch: ForwardBatch) -> torch.Tensor:
        """cu_seqlens as fla takes them (int64), cast once per forward, not in every layer."""
        if "fla_cu" not in batch.derived:
            batch.derived["fla_cu"] = batch.cu_seqlens.long()
        return batch.derived["fla_cu"]

    def _chunks(self, batch: ForwardBatch) -> tuple:
        """cu_seqlens on the host and the (sequence, chunk) index of every 64-token chunk, built
        once per forward. fla would build the index in each layer from a pageable host tensor,
        one host sync per layer."""
        if "fla_chunks" not in batch.derived:
            cu_cpu = torch.tensor([0, *batch.query_lens_cpu], dtype=torch.int64).cumsum(0)
            chunks = self._chunk_indices(cu_cpu, CHUNK, cu_seqlens_cpu=cu_cpu)  # on the host
            batch.derived["fla_chunks"] = (cu_cpu, upload(chunks, batch.cu_seqlens.device))
        return batch.derived["fla_chunks"]

    def delta_rule(self, q, k, v, g, beta, ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, hk, dk = q.shape
        hv, dv = v.shape[1:]
        assert k.shape == q.shape and v.shape[0] == t, f"q {q.shape}, k {k.shape}, v {v.shape} disagree"
        assert hv % hk == 0, f"value heads {hv} must be a multiple of key heads {hk}"
        assert g.shape == beta.shape == (t, hv), f"g/beta must be [T, {hv}], got {tuple(g.shape)}"
        assert ssm_state.shape[1:] == (hv, dk, dv) and ssm_state.dtype == torch.float32, (
            f"ssm_state must be fp32 [slots, {hv}, {dk}, {dv}], got {ssm_state.dtype} {ssm_state.shape}"
        )
        slots = batch.state_slots
        fresh = (batch.context_lens == 0)[:, None, None, None]
        init = ssm_state.index_select(0, slots).masked_fill_(fresh, 0.0)  # [B, Hv, dk, dv]
        common = dict(
            scale=dk**-0.5, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        # keywords only: fused_recurrent's fifth positional parameter is gk, not beta
        if _is_decode(t, batch):  # B sequences of one token: [B, 1, H, d]
            o, final = self._recurrent(
                q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None].float(), beta=beta[:, None].float(),
                **common,
            )  # fmt: skip
            o = o[:, 0]
        elif max(batch.query_lens_cpu) <= RECURRENT_MAX_TOKENS:  # short varlen sequences, one kernel
            o, final = self._recurrent(
                q=q[None], k=k[None], v=v[None], g=g[None].float(), beta=beta[None].float(),
                cu_seqlens=self._cu_seqlens(batch), **common,
            )  # fmt: skip
            o = o[0]
        else:  # one flat varlen sequence: [1, T, H, d]
            cu_cpu, chunks = self._chunks(batch)
            o, final = self._chunk(
                q=q[None], k=k[None], v=v[None], g=g[None].float(), beta=beta[None].float(),
                cu_seqlens=self._cu_seqlens(batch), cu_seqlens_cpu=cu_cpu, chunk_indices=chunks, **common,
            )  # fmt: skip
            o = o[0]
        ssm_state.index_copy_(0, slots, final)
        return o.to(v.dtype)
