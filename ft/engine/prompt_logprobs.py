"""Prompt log-probs: for each sequence of a batch that asks them, the top n and the target's
log-prob of each of its prompt rows, taken on the device from the forward's hidden states.

The logits and their log-softmax are computed ``PROMPT_LOGPROB_BYTES`` at a time, so a chunk of
any length asks no more of the activation reserve for them. Not here: the sampled tokens'
log-probs (``Sampler.draw``), the host lists they become (``logprob_rows``).
"""

from __future__ import annotations

import torch

from ft.layers.sampler import top_parts
from ft.scheduler.step import ScheduledSeq
from ft.utils import upload

# Prompt log-probs are computed this much of a batch at a time (each row's fp32 logits and
# log-softmax, 8 bytes a vocabulary entry: ~880 rows of Qwen3's 151,936), so a chunk of any length
# asks no more of the activation reserve for them (a 16k chunk's at once would take 19 GB)
PROMPT_LOGPROB_BYTES = 1 << 30


def prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, seqs: list[ScheduledSeq], vocab_size: int, first: bool
) -> list[tuple | None]:
    """For each sequence with prompt targets, ``top_parts`` of the log-probs of its first rows,
    one a target, on the first rank (``first``; the others None); the logits a slice of
    ``PROMPT_LOGPROB_BYTES`` at a time on every rank (the vocabulary-parallel head gathers)."""
    step = max(1, PROMPT_LOGPROB_BYTES // (8 * vocab_size))
    out, start = [], 0
    for s in seqs:
        n, parts = len(s.prompt_targets or ()), None
        if n:  # a pageable list would block the host until the forward has run
            targets = upload(torch.tensor(s.prompt_targets, dtype=torch.int64), hidden.device)
            slices = []
            for i in range(0, n, step):
                logits = model.compute_logits(hidden[start + i : start + min(i + step, n)])
                if first:
                    lp = torch.log_softmax(logits, dim=-1)
                    slices.append(top_parts(lp, s.params.prompt_logprobs, targets[i : i + step]))
            if slices:
                parts = (*(torch.cat(t) for t in zip(*slices)), targets)
        out.append(parts)
        start += len(s.token_ids)
    return out
