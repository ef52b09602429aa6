"""A streamed batch's (token, k) pairs grouped by expert: which pairs each kernel call of a layer
runs (the resident experts in place, then each staging group), their tokens, weights and weight
rows uploaded once a layer, and the call that adds a group's terms into the layer's sum. The
offload backend's streaming (``offload.py``) and the CPU's experts (``cpu.py``) use them; what
is staged where, and when, is theirs."""

from __future__ import annotations

import os

import numpy as np
import torch

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
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each run's (tokens, pair weights, weight rows) on ``weights``' device, as ``run_pairs``
    takes them, from one upload and one gather for all of them: a layer streaming a long chunk
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
        out.append((dev[n + at : n + at + m], pair_w[at : at + m], dev[2 * n + at : 2 * n + at + m]))
        at += m
    return out


def device_runs(
    ids: torch.Tensor, weights: torch.Tensor, runs: list[tuple[np.ndarray, np.ndarray]], counts: np.ndarray
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
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
        out.append((tok[at : at + m], pair_w[at : at + m], rows[at : at + m]))
        at += m
    return out


def run_pairs(bank, tensors, x, out, tok: torch.Tensor, pair_w: torch.Tensor, rows: torch.Tensor) -> None:
    """out[tok[i]] += pair_w[i] · expert(x[tok[i]]) on ``tensors``' row ``rows[i]``, k = 1 each
    (on x's device: ``upload_pairs``).

    Each expert sees the same tokens, in the same order, as in one call over the whole batch, and
    the kernel takes the batch's path (``batch_tokens``), so its rows of the result are the same;
    only the order of a token's k terms in ``out`` may differ.
    """
    if len(tok) == 0:
        return
    y = bank.kernel(x[tok], *bank.kernel_weights(tensors), pair_w, rows.unsqueeze(1), batch_tokens=len(x))
    out.index_add_(0, tok, y.float())
