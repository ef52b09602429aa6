"""A streamed batch's (token, k) pairs grouped by expert: which pairs each kernel call of a layer
runs (the resident experts in place, then each staging group), their tokens, weights and weight
rows uploaded once a layer, and the call that adds a group's terms into the layer's sum. The
offload backend's streaming (``offload.py``) and the CPU's experts (``cpu.py``) use them; what
is staged where, and when, is theirs."""

from __future__ import annotations

import os

import numpy as np
import torch

from ft.moe.kernels.into import Into
from ft.moe.kernels.torch_ref import sum_in_routing_order
from ft.utils import upload

# The pairs grouped on the device (``device_runs``) instead of on the host (``Pairs`` +
# ``upload_pairs``): the same runs bit for bit, with O(E) host work instead of O(T·k). The 16-layer
# cut's 8k prefill on 2026-12-02 had the link idle 2.6 ms (one host) to 6-9 ms (another) while the
# host grouped a layer's 80k pairs. On from 2026-12-03 (FT_MOE_DEVICE_PAIRS=0 turns it off for a
# process and the ranks it spawns), timed on an H200 (docs/benchmarks.md): that prefill 453.2 ->
# 398.2 ms (link busy 70 -> 79% of the profiled time), the full 80B bf16 at --memory-ratio 0.94
# 8k prefill 10,990 -> 12,197 tok/s (74 -> 82% of the link), TTFT 1k 613.8 -> 558.5 ms; the
# offload GPU tests' fp32 equality with it on passed. The hybrid backend's CPU share keeps ``Pairs``.
DEVICE_PAIRS = os.environ.get("FT_MOE_DEVICE_PAIRS", "1") != "0"
# A streamed layer's calls read their tokens from the batch and write their terms into ``Terms``
# themselves (``Into``: the grouped GEMMs' rows through a map) instead of a gather of x before each
# call and an ``index_copy_`` of its terms after: on an H200 (2026-12-03) a 16k-token chunk's
# layer spent ~0.9 ms in the gather of its in-place hits alone, beside ~1.5 ms of their GEMMs, and
# the link idled through it (docs/benchmarks.md). The same bytes in the same order, so the same
# results bit for bit. On from 2026-12-03 (FT_MOE_DIRECT_TERMS=0 turns it off; read at each call):
# on an H200 the full 80B bf16 at --memory-ratio 0.94 ran its 32k prefill at 81% of the link with
# it, 82% without (one run each: no gain in time), and peaked at 130.70 GiB of device memory
# instead of 132.28, inside its 131.41 GiB plan (the gathered x and the calls' own outputs are
# gone); the GPU tests' bf16 / NVFP4 on-off equality passed (docs/benchmarks.md).
DIRECT_TERMS = os.environ.get("FT_MOE_DIRECT_TERMS", "1") != "0"


class Pairs:
    """A batch's (token, k) pairs grouped by expert, to hand a kernel the pairs of some experts."""

    def __init__(self, ids_h: np.ndarray, num_experts: int) -> None:
        flat = ids_h.reshape(-1)  # [T*k] pair p = token * k + j
        # pairs by expert, ascending within one; numpy radix-sorts 16-bit keys (8x faster at 80k)
        self.order = np.argsort(flat.astype(np.uint16) if num_experts <= 1 << 16 else flat, kind="stable")
        self.counts = np.bincount(flat, minlength=num_experts)  # [E]
        self.starts = np.cumsum(self.counts) - self.counts

    def of(self, experts: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(the pairs routed to ``experts``, the weight row each runs on: ``rows[i]`` for
        ``experts[i]``, by default i). Each expert's pairs are one run of ``order``: the runs'
        positions come from one repeat, not a slice per expert."""
        counts = self.counts[experts]
        rows = np.arange(len(experts)) if rows is None else rows
        if len(experts) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ends = np.cumsum(counts)
        at = np.arange(ends[-1]) + np.repeat(self.starts[experts] - (ends - counts), counts)
        return self.order[at], np.repeat(rows, counts)


def upload_pairs(
    runs: list[tuple[np.ndarray, np.ndarray]], weights: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each run's (tokens, pair weights, weight rows, pairs) on ``weights``' device, as
    ``run_pairs`` and ``Terms.run`` take them (pairs: indices into the batch's [T*k]), from one
    upload and one gather for all of them: a layer streaming a long chunk
    runs a kernel call per staging group, and one pinned upload a call (two arrays each) cost
    ~250 us of host time on an H200's host (2026-12-01, 14 a layer), as did the per-call
    operators on the device's tensors (a division and a gather, ~45 us of host time each)."""
    k = weights.shape[1]
    sel = np.concatenate([np.zeros(0, np.int64)] + [r[0].astype(np.int64, copy=False) for r in runs])
    rows = np.concatenate([np.zeros(0, np.int64)] + [r[1].astype(np.int64, copy=False) for r in runs])
    n = len(sel)
    dev = upload(torch.from_numpy(np.concatenate([sel, sel // k, rows])), weights.device)
    pair_w = weights.reshape(-1)[dev[:n]].unsqueeze(1)  # [P, 1]
    out, at = [], 0
    for r in runs:
        m = len(r[0])
        run = slice(at, at + m)
        out.append((dev[n:][run], pair_w[run], dev[2 * n :][run], dev[:n][run]))
        at += m
    return out


def device_runs(
    ids: torch.Tensor, weights: torch.Tensor, runs: list[tuple[np.ndarray, np.ndarray]], counts: np.ndarray
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``upload_pairs([Pairs(ids_h, E).of(experts, rows) for experts, rows in runs], weights)``
    computed on ``ids``' device: ``ids`` [T, k] the batch's routed experts there, ``runs`` the
    (experts, weight rows) of each kernel call, an expert in one run at most, ``counts`` [E] the
    batch's pairs per expert (on the host). The host uploads each expert's position in the runs
    and its weight row ([E] each); the device sorts the batch's pairs by position. The sort is
    stable, so an expert's pairs keep their ascending order, and the runs come out as the
    host's grouping gives them, the same tokens, weights and rows in the same order."""
    num_experts, k = len(counts), ids.shape[1]
    position = np.full(num_experts, num_experts, np.int64)  # experts in no run sort last, unused
    row_of = np.zeros(num_experts, np.int64)
    sizes, at = [], 0
    for experts, rows in runs:
        position[experts] = at + np.arange(len(experts))
        row_of[experts] = rows
        at += len(experts)
        sizes.append(int(counts[experts].sum()))
    tables = upload(torch.from_numpy(np.concatenate([position, row_of])), ids.device)
    flat = ids.reshape(-1)
    order = torch.argsort(tables[:num_experts][flat], stable=True)  # [T*k] pairs by position
    n = sum(sizes)
    order = order[:n]
    tok = order // k
    pair_w = weights.reshape(-1)[order].unsqueeze(1)  # [P, 1]
    rows = tables[num_experts:][flat[order]]
    out, at = [], 0
    for m in sizes:
        run = slice(at, at + m)
        out.append((tok[run], pair_w[run], rows[run], order[run]))
        at += m
    return out


def pair_terms(bank, tensors, x, tok: torch.Tensor, pair_w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[P, H] in x's dtype: pair_w[i] · expert(x[tok[i]]) on ``tensors``' row ``rows[i]``, k = 1
    each (on x's device: ``upload_pairs``), each term rounded once as a whole batch's call rounds it.

    Each expert sees the same tokens, in the same order, as in one call over the whole batch, and
    the kernel takes the batch's path and tiles (``batch_tokens``, ``batch_experts``), so its rows
    are that call's terms."""
    return bank.kernel(
        x[tok], *bank.kernel_weights(tensors), pair_w, rows.unsqueeze(1), batch_tokens=len(x),
        batch_experts=bank.num_experts,
    )  # fmt: skip


class Terms:
    """A streamed layer's routed terms by (token, k) pair, [T, k (+ 1 for the shared expert's), H]
    in x's dtype: each kernel call writes its pairs' rows (``run``), the host CPU's share its own
    (``put``), and ``total`` sums each token's in k order, the shared expert's last, in fp32 and
    rounds once: the order and the rounding of the resident kernels' sum (``sum_topk``), where an
    fp32 [T, H] the calls added into (``index_add_``: atomics over every pair's H values, and each
    call's terms converted to fp32 first) took ~3 ms a layer of a 16k-token chunk on an H200
    (2026-12-03), as long as the layer's grouped GEMMs."""

    def __init__(self, x: torch.Tensor, top_k: int, shared: bool) -> None:
        self.k, self.width = top_k, top_k + int(shared)
        self.buf = torch.empty(x.shape[0], self.width, x.shape[1], dtype=x.dtype, device=x.device)

    def rows(self, pair: torch.Tensor) -> torch.Tensor:
        """The rows of ``buf`` viewed [T * width, H] that pairs ``pair`` (indices into the
        batch's [T*k]) write."""
        return pair + pair // self.k if self.width > self.k else pair  # [T, k + 1] rows

    def put(self, pair: torch.Tensor, y: torch.Tensor) -> None:
        """Rows y[i] for pairs ``pair[i]``."""
        if len(pair) > 0:
            self.buf.view(-1, self.buf.shape[-1]).index_copy_(0, self.rows(pair), y)

    def run(self, bank, tensors, x, tok, pair_w, rows, pair) -> None:
        """One call's pairs (a run of ``upload_pairs`` / ``device_runs``) computed into their rows:
        with ``DIRECT_TERMS`` by the kernel itself (``Into``) where it takes the batch's MMA path."""
        if len(tok) == 0:
            return
        if DIRECT_TERMS and not bank.takes_gemv(len(x)):
            into = Into(tok, self.buf.view(-1, self.buf.shape[-1]), self.rows(pair))
            bank.kernel(
                x,
                *bank.kernel_weights(tensors),
                pair_w,
                rows.unsqueeze(1),
                batch_tokens=len(x),
                into=into,
                batch_experts=bank.num_experts,
            )
            return
        self.put(pair, pair_terms(bank, tensors, x, tok, pair_w, rows))

    def total(self, shared_term: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H]: every pair written, ``shared_term`` [T, H] (x's dtype) with a shared slot."""
        if (shared_term is None) != (self.width == self.k):
            raise ValueError(f"a shared term comes iff the terms have its slot ({self.width} for k={self.k})")
        if shared_term is not None:
            self.buf[:, self.k] = shared_term
        if self.buf.is_cuda:
            from ft.moe.kernels.triton_combine import sum_topk

            return sum_topk(self.buf)
        # a fresh, contiguous [T, H]: ``.float()`` of fp32 terms would be a strided view of ``buf``,
        # which the block's all-reduce then sums as if contiguous (gloo: other rows' values)
        return sum_in_routing_order(self.buf).to(self.buf.dtype)
