"""Sampling and log-probs from final logits.

Log-probs are those of the model's raw distribution (before temperature, top-k, top-p), as in
vLLM. A request with a seed samples from a generator seeded by (seed, output index), so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.sampling_params import Logprobs, SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprobs: Logprobs | None  # top-n plus the chosen token, when asked for


def top_logprobs(logprobs: torch.Tensor, n: int, chosen: torch.Tensor) -> list[Logprobs]:
    """Per row: the top-n entries of ``logprobs`` [R, V] plus the ``chosen`` [R] token."""
    top_v, top_i = logprobs.topk(n, dim=-1) if n > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    rows = []
    for r in range(logprobs.shape[0]):
        d = {int(t): float(v) for t, v in zip(top_i[r].tolist(), top_v[r].tolist())}
        d[int(chosen[r])] = float(picked[r])
        rows.append(d)
    return rows


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the tokens strictly more likely than it already cover top_p
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample_row(
    logits: torch.Tensor, params: SamplingParams, output_index: int, generator: torch.Generator
) -> int:
    if params.greedy:
        return int(logits.argmax())
    scaled = _filter(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    if params.seed is not None:
        generator = torch.Generator(device=logits.device)
        generator.manual_seed((params.seed * 1_000_003 + output_index) % (2**63))
    # Gumbel-style race: argmax p / Exp(1) is a sample from p
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int((probs / noise).argmax())


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> list[SampleResult]:
        """logits [B, V] fp32, one row per sampling sequence."""
        if not params:
            return []
        if all(p.greedy for p in params):  # one device-to-host copy for the common case
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.tensor(
                [
                    sample_row(logits[i], p, k, self.generator)
                    for i, (p, k) in enumerate(zip(params, output_index))
                ],
                device=logits.device,
            )
        want = [p.logprobs for p in params]
        out = [SampleResult(int(t), None) for t in tokens.tolist()]
        if any(n is not None for n in want):
            lp = torch.log_softmax(logits.float(), dim=-1)
            rows = top_logprobs(lp, max(n or 0 for n in want), tokens)
            for i, n in enumerate(want):
                if n is not None:
                    keep = sorted(rows[i].items(), key=lambda kv: -kv[1])[:n]
                    out[i].logprobs = dict(keep) | {out[i].token_id: rows[i][out[i].token_id]}
        return out
