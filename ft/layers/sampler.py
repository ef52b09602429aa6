"""Sampling and log-probs from final logits, for the whole batch at once.

Log-probs are those of the model's raw distribution (before temperature, top-k, top-p), as in
vLLM. Sampled rows run one set of tensor ops whatever their mix of temperature, top-k and top-p,
and the chosen tokens come back to the host in a single copy: a per-row loop would cost a few
kernels and a device sync per row, milliseconds per decode step at batch 64.

A token is drawn by the exponential race: argmax p / E over the vocabulary with E ~ Exp(1) i.i.d.
is a sample from p. Unseeded rows take E from the sampler's generator (reproducible for a fixed
engine seed). A request with a seed takes E from a counter-based hash of (seed, output index,
token id), so its tokens depend only on those and its own logits, never on which other requests
share the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.layers.penalties import PenaltyState, process
from ft.sampling_params import Logprobs, SamplingParams
from ft.utils import upload_values


@dataclass
class Draw:
    """A batch's sampled tokens [B], and for the log-probs its rows ask for the top n values and
    token ids [B, n] of their log-softmax and the chosen tokens' [B]; on the device, or copied."""

    tokens: torch.Tensor
    top_v: torch.Tensor | None = None
    top_i: torch.Tensor | None = None
    picked: torch.Tensor | None = None

    def to_host(self, non_blocking: bool = True) -> Draw:
        """The same on the host; ``non_blocking``: copies issued to pinned memory without
        waiting, to be read once the stream has passed them (an event)."""
        parts = (self.tokens, self.top_v, self.top_i, self.picked)
        return Draw(*(t.to("cpu", non_blocking=non_blocking) if t is not None else None for t in parts))


@dataclass
class SampleResult:
    token_id: int
    logprobs: Logprobs | None  # top-n plus the chosen token, when asked for


def top_parts(logprobs: torch.Tensor, n: int, chosen: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The top-n values and token ids [R, n] of ``logprobs`` [R, V], and the ``chosen`` [R]
    tokens' values [R], where ``logprobs`` is (no host synchronisation)."""
    top_v, top_i = logprobs.topk(n, dim=-1) if n > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    return top_v, top_i, logprobs.gather(1, chosen[:, None])[:, 0]


def logprob_rows(top_v: list, top_i: list, picked: list, chosen: list) -> list[Logprobs]:
    """``top_parts``' tensors read back as lists: per row, its top-n entries plus the chosen token."""
    rows = []
    for v, i, p, c in zip(top_v, top_i, picked, chosen):
        d = dict(zip(i, v))
        d[c] = p
        rows.append(d)
    return rows


def _int64(c: int) -> int:
    """The signed int64 with the bits of ``c`` mod 2**64 (torch has no uint64 arithmetic)."""
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _int64(0x9E3779B97F4A7C15)  # splitmix64's stream increment, 2**64 / golden ratio
_MUL1 = _int64(0xBF58476D1CE4E5B9)
_MUL2 = _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64: torch shifts arithmetically, so clear the copied sign bits."""
    return (x >> n).bitwise_and_((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function (Stafford's Mix13) on int64 tensors.

    Products wrap mod 2**64 on CPU and CUDA, so this is bit-for-bit the uint64 function. After
    the first step ``x`` is a fresh tensor, so the rest works in place: at [R, V] that halves
    the transient memory.
    """
    x = x ^ _shr(x, 30)
    x *= _MUL1
    x ^= _shr(x, 27)
    x *= _MUL2
    x ^= _shr(x, 31)
    return x


def seeded_exponential(
    seeds: list[int], output_index: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [R, vocab], a pure function of (seed, output index, token id) per row.

    Each row is the splitmix64 stream started at key = mix64(mix64(seed) + output index): its
    token-``v`` element is mix64(key + (v + 1) * golden). The top 23 bits give u = (m + 0.5) / 2**23,
    exact in fp32 and strictly inside (0, 1), so E = -log u is finite and never zero.
    """
    pairs = upload_values(
        [[_int64(s), i] for s, i in zip(seeds, output_index)], torch.int64, device
    )  # [R, 2]
    key = mix64(mix64(pairs[:, 0]) + pairs[:, 1])  # [R]
    counter = torch.arange(1, vocab + 1, device=device) * _GOLDEN  # [V]
    bits = mix64(key[:, None] + counter)  # [R, V]
    return _shr(bits, 41).float().add_(0.5).mul_(2.0**-23).log_().neg_()


def keep_threshold(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per row, the smallest logit that top-k then top-p keep: [R, 1], -inf for rows with no cut.

    ``top_k`` counts as no cut when <= 0 or >= V, ``top_p`` when 1. Both keep a prefix of the
    descending logits, so one threshold per row says it all. Top-k keeps every token tied with
    the k-th value. Top-p drops a token once the tokens strictly more likely than it already
    cover top_p, over the top-k survivors' softmax. A tied group is decided by its first token,
    which sees only the mass strictly before the group, so ties stay or go together and nothing
    depends on how the sort orders them (the per-row filter this replaced kept part of a group).

    Top-k runs first, so only the top max(k) logits need sorting, unless some row has top-p
    without top-k: then every row gets the full sort.
    """
    vocab = scaled.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    cut = [k < vocab or p < 1.0 for k, p in zip(ks, top_p)]
    width = max(k for k, c in zip(ks, cut) if c)
    if width < vocab:
        values = scaled.topk(width, dim=-1).values  # [R, W], descending
    else:
        values = scaled.sort(dim=-1, descending=True).values
    device = scaled.device
    k_index = upload_values([min(k, width) - 1 for k in ks], torch.int64, device)[:, None]  # [R, 1]
    p = upload_values(top_p, torch.float32, device)[:, None]
    no_cut = upload_values([not c for c in cut], torch.bool, device)[:, None]
    kth = values.gather(1, k_index)  # [R, 1]
    # the survivors' normaliser counts the ties with the k-th value that fell outside the window
    lse = scaled.masked_fill(scaled < kth, float("-inf")).logsumexp(-1, keepdim=True)
    probs = (values - lse).exp() * (values >= kth)  # [R, W]
    before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # mass sorted ahead of each token
    kept = (values >= kth) & ((before < p) | (p >= 1.0))  # a prefix
    # never empty, as vLLM's: a top_p under float32's least (1e-300) is 0 here, and a row of NaN
    # (a repetition_penalty of 1e-300, 0 in float32, makes a logit inf) compares false everywhere
    kept[:, 0] = True
    # a threshold on values keeps the rest of the last kept token's tied group too
    threshold = values.gather(1, kept.sum(-1, keepdim=True) - 1)
    return threshold.masked_fill(no_cut, float("-inf"))


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.penalties: PenaltyState | None = None  # made when a first request penalises
        self.num_slots = 0  # the state slots a row's penalties are kept for (the runner's pool)
        self.eos_ids: tuple[int, ...] = ()  # the model's end-of-sequence tokens (the runner's config)

    def banned(
        self, params: list[SamplingParams], output_index: list[int]
    ) -> list[tuple[int, tuple[int, ...]]]:
        """(row, its stop tokens) of the rows that have generated fewer than their ``min_tokens``:
        they may not end yet (their stop_token_ids, and the model's end-of-sequence tokens unless
        ``ignore_eos``), as vLLM's min-tokens processor bans them."""
        out = []
        for r, (p, n) in enumerate(zip(params, output_index)):
            if n < p.min_tokens:
                stops = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_ids)
                if stops:
                    out.append((r, stops))
        return out

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> torch.Tensor:
        """Tokens [R] for rows that are not ``greedy``, left on the device."""
        device, vocab = logits.device, logits.shape[-1]
        # past float32's range a temperature is its largest: inf would make a banned token's -inf NaN
        hottest = torch.finfo(torch.float32).max
        temperature = upload_values([min(p.temperature, hottest) for p in params], torch.float32, device)
        scaled = logits.float() / temperature[:, None]  # [R, V]
        # min-p first, as vLLM: top-p then weighs the mass of the tokens min-p keeps
        if any(p.min_p > 0 for p in params):  # p / p_max >= min_p, in logits: s >= s_max + log(min_p)
            floor = upload_values(
                [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], torch.float32, device
            )
            scaled.masked_fill_(scaled < scaled.amax(-1, keepdim=True) + floor[:, None], float("-inf"))
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            threshold = keep_threshold(scaled, [p.top_k for p in params], [p.top_p for p in params])
            scaled.masked_fill_(scaled < threshold, float("-inf"))
        probs = scaled.softmax(-1)
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            noise.exponential_(1.0, generator=self.generator)
        if seeded:
            seeds, indices = [params[i].seed for i in seeded], [output_index[i] for i in seeded]
            rows = upload_values(seeded, torch.int64, device)
            noise.index_copy_(0, rows, seeded_exponential(seeds, indices, vocab, device))
        return probs.div_(noise).argmax(-1)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> list[SampleResult]:
        """logits [B, V] fp32, one row per sampling sequence."""
        if not params:
            return []
        return self.results(self.draw(logits, params, output_index).to_host(non_blocking=False), params)

    def draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_index: list[int],
        seen: list | None = None,
        rows: list[tuple[int, str]] | None = None,
    ) -> Draw:
        """The chosen tokens and the log-probs the rows ask for, left on the device (no host
        synchronisation: ``ModelRunner.launch`` copies them to the host behind an event). The
        log-probs are the model's, before any logits processing (``process``)."""
        tokens = self.tokens(logits, params, output_index, seen, rows)
        want = [p.logprobs for p in params if p.logprobs is not None]
        if not want:
            return Draw(tokens)
        return Draw(tokens, *top_parts(torch.log_softmax(logits.float(), dim=-1), max(want), tokens))

    def tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_index: list[int],
        seen: list | None = None,
        rows: list[tuple[int, str]] | None = None,
    ) -> torch.Tensor:
        """The chosen tokens [B], left on the device. ``rows``: each row's (state slot, request
        id), whose penalty counts the sampler keeps (``PenaltyState``), loaded from ``seen``
        (each row's (prompt, output) token ids so far, or None: ``ScheduledSeq.seen``) where
        given; without ``rows``, each penalised row's ``seen`` alone."""
        pen = [i for i, p in enumerate(params) if p.penalises]
        counts = in_prompt = slots = None
        if pen:
            state, counts, in_prompt, slots = self._penalty_rows(
                logits, pen, seen or [None] * len(params), rows
            )
        banned = self.banned(params, output_index)
        if banned or any(p.processes_logits for p in params):
            logits = process(logits, params, counts, in_prompt, banned)
        hot = [i for i, p in enumerate(params) if not p.greedy]
        if len(hot) == len(params):
            tokens = self.sample(logits, params, output_index)
        else:
            tokens = logits.argmax(dim=-1)
            if hot:
                at = upload_values(hot, torch.int64, logits.device)
                picked = self.sample(
                    logits.index_select(0, at), [params[i] for i in hot], [output_index[i] for i in hot]
                )
                tokens.index_copy_(0, at, picked)
        if pen and rows is not None:  # each token counted as drawn: the next step's (ahead, too) sees it
            state.count(
                slots,
                tokens if len(pen) == len(params) else tokens[upload_values(pen, torch.int64, tokens.device)],
            )
        return tokens

    def _penalty_rows(self, logits: torch.Tensor, pen: list[int], seen: list, rows) -> tuple:
        """(state, counts, prompt marks [R, V], slots [R]) of the penalised rows ``pen``."""
        vocab, device = logits.shape[-1], logits.device
        if rows is None:  # a state of their own, from their tokens
            state, slots, owners = PenaltyState(vocab, device), list(range(len(pen))), [str(i) for i in pen]
            state.load(slots, owners, [seen[i] for i in pen])
        else:
            if self.penalties is None or self.penalties.vocab != vocab:
                self.penalties = PenaltyState(vocab, device, self.num_slots)
            state = self.penalties
            fresh = [i for i in pen if seen[i] is not None]
            if fresh:
                state.load([rows[i][0] for i in fresh], [rows[i][1] for i in fresh], [seen[i] for i in fresh])
            slots, owners = [rows[i][0] for i in pen], [rows[i][1] for i in pen]
        return state, *state.rows(slots, owners)

    @staticmethod
    def results(draw: Draw, params: list[SamplingParams]) -> list[SampleResult]:
        """Each row's result from a ``draw`` on the host: its token, and for a row asking n
        log-probs the n most likely tokens' plus the chosen one's."""
        chosen = draw.tokens.tolist()
        out = [SampleResult(t, None) for t in chosen]
        if draw.picked is None:
            return out
        tops = logprob_rows(draw.top_v.tolist(), draw.top_i.tolist(), draw.picked.tolist(), chosen)
        for r, p in enumerate(params):
            if p.logprobs is not None:
                keep = sorted(tops[r].items(), key=lambda kv: -kv[1])[: p.logprobs]
                out[r].logprobs = dict(keep) | {chosen[r]: tops[r][chosen[r]]}
        return out
