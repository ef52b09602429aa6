"""One HTTP request's generation: its choices (prompts × n) from submission to the last token.

A ``Generation`` submits one engine request per choice, turns the engine's deltas into text
(``TextStream``: whole characters, stop strings cut) and yields ``Update``s for the response
writers. It ends a choice early when a stop string appears, aborting the engine request, and
``close()`` aborts whatever is still running (a client that went away, an error) so its KV
blocks and state slot are freed at once. It knows nothing of the OpenAI response shapes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from ft.sampling_params import Logprobs, SamplingParams
from ft.server.detokenizer import TextOptions, TextStream
from ft.server.engine_client import EngineClient, EngineDeadError
from ft.server.engine_process import Delta
from ft.server.metrics import Metrics
from ft.server.protocol import APIError
from ft.server.tokenizer import Tokenizer


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: str | None = None
    # what ended a "stop" choice, as vLLM reports it: the stop string, or the stop_token_ids id;
    # None for eos (checked first, as vLLM), a length or an abort
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Update:
    choice: Choice
    text: str  # text released by this update
    token_ids: list[int]  # tokens new in this update
    logprobs: list[Logprobs] | None
    finished: bool


class Generation:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer | None,
        metrics: Metrics,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        text: TextOptions,
        max_waiting: int | None,
    ) -> None:
        self.client, self.metrics, self.max_waiting = client, metrics, max_waiting
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.id = request_id
        self.choices: list[Choice] = []
        self._params: list[SamplingParams] = []
        self._options = text
        self._stop_ids = set(params.stop_token_ids)
        self._eos = tokenizer.eos_token_id if tokenizer is not None and not params.ignore_eos else None
        for p, prompt in enumerate(prompts):
            for i in range(n):
                # each choice draws its own sample: a seeded request seeds choice i with seed + i
                seed = None if params.seed is None else params.seed + i
                self._params.append(replace(params, seed=seed))
                stream = TextStream(tokenizer, text, params.min_tokens)
                self.choices.append(Choice(p * n + i, f"{request_id}-{p * n + i}", prompt, stream))
        self._n = n
        self._by_id = {c.request_id: c for c in self.choices}
        self._prompt_tokens = sum(len(p) for p in prompts)
        self._sink: asyncio.Queue = asyncio.Queue()
        self._started = False

    @property
    def prompt_tokens(self) -> int:
        """Usage counts each prompt once, however many choices share it."""
        return self._prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Of ``prompt_tokens``, those the prefix cache held: each prompt's once too (its first
        choice's), not once per choice, which could count more than the prompt."""
        return sum(c.num_cached_tokens for c in self.choices[:: self._n])

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    async def start(self) -> None:
        if self.client.dead is not None:
            raise APIError(500, f"the engine has stopped: {self.client.dead}", "server_error")
        if self.max_waiting is not None and self.client.num_unscheduled >= self.max_waiting:
            raise APIError(
                503,
                f"the server is busy: {self.client.num_unscheduled} requests are waiting; retry later",
                "server_busy",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self._started = True
        requests = [(c.request_id, c.prompt_token_ids, p) for c, p in zip(self.choices, self._params)]
        await self.client.add(requests, self._sink, self.arrival)

    async def updates(self) -> AsyncIterator[Update]:
        """Updates until every choice has finished."""
        while not all(c.finished for c in self.choices):
            item = await self._sink.get()
            if isinstance(item, EngineDeadError):
                raise item
            if item is None:
                continue  # woken by cancel()
            update = self._apply(item)
            if update is not None:
                yield update

    async def run(self) -> None:
        """Consume to the end (non-streaming answers read the choices afterwards)."""
        async for _ in self.updates():
            pass

    def close(self) -> None:
        """Abort the choices still running (idempotent)."""
        if not self._started:
            return
        unfinished = [c for c in self.choices if not c.finished]
        self.client.release([c.request_id for c in unfinished])
        for c in unfinished:
            c.finish_reason = "abort"
            self.metrics.finished("abort", time.monotonic() - self.arrival)

    def cancel(self) -> None:
        """Close, and wake ``updates()`` so that it ends."""
        self.close()
        self._sink.put_nowait(None)

    def _apply(self, d: Delta) -> Update | None:
        choice = self._by_id[d.request_id]
        if choice.finished:
            return None  # cut by a stop string; the engine's last outputs are dropped
        choice.token_ids += d.token_ids
        if d.logprobs is not None:
            choice.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            choice.prompt_logprobs = d.prompt_logprobs
        choice.num_cached_tokens = d.num_cached_tokens
        final = d.finish_reason is not None
        # a stop token (eos, stop_token_ids) counts as generated but is not part of the text,
        # unless the request keeps what stopped it
        stop_token = d.finish_reason == "stop" and d.token_ids and not self._options.include_stop
        text_ids = d.token_ids[:-1] if stop_token else d.token_ids
        text = choice.text.add(text_ids, final, len(choice.token_ids))
        if choice.text.stopped:
            if not final:
                self.client.release([choice.request_id])
            choice.finish_reason, final = "stop", True
            choice.stop_reason = choice.text.stop_string
        elif final:
            choice.finish_reason = d.finish_reason
            last = d.token_ids[-1] if d.finish_reason == "stop" and d.token_ids else None
            if last in self._stop_ids and last != self._eos:
                choice.stop_reason = last
        if final:
            self.metrics.finished(choice.finish_reason, time.monotonic() - self.arrival)
        if not (d.token_ids or final or text):
            return None  # a prefill chunk: nothing to tell the client
        return Update(choice, text, d.token_ids, d.logprobs, final)
