"""The server's app in this process over a scripted engine, driven by the ``openai`` client.

For the shapes of answers (fields, chunks, finish reasons, usage, log-probs) the model does not
matter, only which tokens come: ``ScriptedEngine`` stands where ``EngineClient`` does and answers
every request with the tokens of a script (the same for every request, or chosen by the prompt),
one token a step, stopping as the engine does (max_tokens, eos unless ignored, stop_token_ids).
Each token's log-probs row holds it at -1.0 and the ids after it at -2.0, -3.0, ...: the numbers
are known without a model. The ``openai`` client talks to the app through httpx's ASGI transport,
so its own parsing of every answer is part of each test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import openai

from ft.sampling_params import SamplingParams
from ft.server.app import build_app
from ft.server.engine_process import Delta, EngineInfo
from ft.server.metrics import Metrics
from ft.server.serving import ServerState
from ft.server.tokenizer import Tokenizer
from tests.tiny_tokenizer import VOCAB_SIZE, build_tokenizer, eos_token_id

MODEL = "tiny"
CONTEXT = 512
EOS = eos_token_id()


def row(token: int, k: int) -> dict[int, float]:
    """The scripted log-probs of ``token`` with ``k`` alternatives."""
    out = {token: -1.0}
    for j in range(1, k + 1):
        out.setdefault((token + j) % VOCAB_SIZE, -1.0 - j)
    return out


class ScriptedEngine:
    """The parts of ``EngineClient`` the HTTP side uses; ``script(prompt) -> output tokens``."""

    def __init__(self, script: Callable[[list[int]], list[int]]) -> None:
        self.script = script
        self.info = EngineInfo(CONTEXT, VOCAB_SIZE, 16, 64, 8, 0, 0, 0, 1, "cpu", "float32")
        self.dead = None
        self.stats: dict = {}
        self.num_unscheduled = 0
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        self.released: list[str] = []
        self._tasks: set[asyncio.Task] = set()

    def attach(self, loop) -> None:
        pass

    def shutdown(self) -> None:
        pass

    async def add(self, requests, sink: asyncio.Queue, arrival: float) -> None:
        self.added += requests
        for rid, prompt, params in requests:
            task = asyncio.ensure_future(self._run(rid, prompt, params, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def release(self, request_ids: list[str]) -> None:
        self.released += request_ids

    async def _run(self, rid: str, prompt: list[int], p: SamplingParams, sink: asyncio.Queue) -> None:
        plp = None
        if p.prompt_logprobs is not None:
            plp = [None] + [row(t, p.prompt_logprobs) for t in prompt[1:]]
        if p.max_tokens == 0:
            sink.put_nowait(Delta(rid, [], [] if p.logprobs is not None else None, plp, "length"))
            return
        out = self.script(prompt)
        for i in range(p.max_tokens):
            await asyncio.sleep(0)
            if rid in self.released:
                return
            tok = out[i % len(out)]
            stop = (tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids
            finish = "stop" if stop and i + 1 >= p.min_tokens else None
            if finish is None and i + 1 == p.max_tokens:
                finish = "length"
            lps = [row(tok, p.logprobs)] if p.logprobs is not None else None
            sink.put_nowait(Delta(rid, [tok], lps, plp if i == 0 else None, finish))
            if finish:
                return


def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())


def make_app(script: Callable[[list[int]], list[int]] | list[int], reasoning_parser: str | None = None):
    fixed = script
    engine = ScriptedEngine(script if callable(script) else (lambda _prompt: fixed))
    metrics = Metrics(MODEL, lambda: {})
    state = ServerState(engine, tokenizer(), metrics, MODEL, reasoning_parser=reasoning_parser)
    return build_app(state), engine


def client(app) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    http = httpx.AsyncClient(transport=transport, base_url="http://ft.test")
    return openai.AsyncOpenAI(base_url="http://ft.test/v1", api_key="none", max_retries=0, http_client=http)


def raw(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ft.test")


def run(coro):
    return asyncio.run(coro)


async def collect(stream) -> list:
    return [chunk async for chunk in stream]
