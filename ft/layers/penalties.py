"""Logits processing before a token is chosen: a request's logit bias, then its repetition,
frequency and presence penalties, with what the penalties count kept on the device.

The penalties read, per request, how often each token has been generated and which tokens its
prompt holds. ``PenaltyState`` keeps both per state slot ([slots, V]: a 152k vocabulary at 64
slots is ~50 MB, allocated when a first request penalises): built once, when a request first
samples after it is admitted (its prompt and its output so far, ``ScheduledSeq.seen``), then
each token it samples is counted on the device as it is drawn. So a step scheduled ahead (its
token in flight unknown to the host) counts it, and a step does not send the prompt again (a
32k-token prompt's ids were uploaded with every step before).

Not here: temperature, top-k, top-p, min-p (``ft.layers.sampler``), which act on the processed
logits of sampled rows only.
"""

from __future__ import annotations

import torch

from ft.sampling_params import SamplingParams
from ft.utils import upload_values


class PenaltyState:
    """Output-token counts (fp32) and prompt-token marks (bool), a row per state slot."""

    def __init__(self, vocab: int, device: torch.device, rows: int = 0) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(rows, vocab, device=device)
        self.in_prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.owners: dict[int, str] = {}  # slot -> the request its row was built for

    def _grow(self, rows: int) -> None:
        have = self.counts.shape[0]
        if rows > have:  # only where the slots were not known up front (``Sampler.num_slots``)
            more = rows - have
            self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab)])
            self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(more, self.vocab)])

    def load(self, slots: list[int], owners: list[str], seen: list[tuple[list[int], list[int]]]) -> None:
        """Rows ``slots`` rebuilt for requests ``owners`` from their (prompt, output so far) token ids."""
        self._grow(max(slots) + 1)
        self.owners.update(zip(slots, owners))
        rows = upload_values(slots, torch.int64, self.device)
        self.counts.index_fill_(0, rows, 0.0)
        self.in_prompt.index_fill_(0, rows, False)
        out_rows = [r for r, (_, output) in zip(slots, seen) for _ in output]
        prompt_rows = [r for r, (prompt, _) in zip(slots, seen) for _ in prompt]
        out_ids = [t for _, output in seen for t in output]
        prompt_ids = [t for prompt, _ in seen for t in prompt]
        n, m = len(out_ids), len(prompt_ids)
        at = upload_values(out_rows + prompt_rows + out_ids + prompt_ids, torch.int64, self.device)
        self.counts.index_put_(
            (at[:n], at[n + m : 2 * n + m]), torch.ones(n, device=self.device), accumulate=True
        )
        self.in_prompt[at[n : n + m], at[2 * n + m :]] = True

    def rows(self, slots: list[int], owners: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counts, prompt marks) [R, V] of rows ``slots``, and the slots [R] on the device."""
        for slot, owner in zip(slots, owners):
            if self.owners.get(slot) != owner:
                raise RuntimeError(
                    f"penalties of request {owner!r}: slot {slot} holds {self.owners.get(slot)!r}'s (its "
                    "first sampling step after admission must send its tokens: ScheduledSeq.seen)"
                )
        at = upload_values(slots, torch.int64, self.device)
        return self.counts.index_select(0, at), self.in_prompt.index_select(0, at), at

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each row's sampled token [R], counted (on the device: no host sync)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)


def process(
    logits: torch.Tensor,
    params: list[SamplingParams],
    counts: torch.Tensor | None,
    in_prompt: torch.Tensor | None,
    banned: list[tuple[int, tuple[int, ...]]] = (),
) -> torch.Tensor:
    """[B, V] fp32: the logits a token is chosen from, by each row's ``SamplingParams``: its
    ``logit_bias`` added, then its repetition penalty on every token of its prompt or output so
    far, then its frequency and presence penalties on the output's. ``counts`` / ``in_prompt``
    [R, V]: the output counts and prompt marks of the rows that penalise, in order
    (``PenaltyState.rows``). ``banned``: (row, token ids) that row may not choose, -inf last
    (a row under its ``min_tokens``: its stop tokens, ``Sampler.banned``)."""
    x = _penalised(logits.to(torch.float32, copy=True), params, counts, in_prompt)  # one copy
    if banned:
        at = [(r, t) for r, toks in banned for t in toks if t < x.shape[1]]  # an eos id past the vocab: none
        rows_toks = upload_values([[r for r, _ in at], [t for _, t in at]], torch.int64, x.device)
        x[rows_toks[0], rows_toks[1]] = float("-inf")
    return x


def _penalised(
    x: torch.Tensor, params: list[SamplingParams], counts: torch.Tensor | None, in_prompt: torch.Tensor | None
) -> torch.Tensor:
    """``process`` but the bans, in place on its fp32 copy."""
    device = x.device
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        rows, toks, vals = zip(*bias)
        at = upload_values([list(rows), list(toks)], torch.int64, device)
        x.index_put_((at[0], at[1]), upload_values(list(vals), torch.float32, device), accumulate=True)
    pen = [r for r, p in enumerate(params) if p.penalises]
    if not pen:
        return x
    knobs = upload_values(
        [
            [params[r].repetition_penalty, params[r].frequency_penalty, params[r].presence_penalty]
            for r in pen
        ],
        torch.float32,
        device,
    )  # [R, 3]
    rep, freq, pres = knobs[:, 0:1], knobs[:, 1:2], knobs[:, 2:3]
    rows = upload_values(pen, torch.int64, device)
    y = x.index_select(0, rows)
    y = torch.where((counts > 0) | in_prompt, torch.where(y > 0, y / rep, y * rep), y)  # r = 1: y
    y = y - freq * counts - pres * (counts > 0)
    return x.index_copy_(0, rows, y)
