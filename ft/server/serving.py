"""What the completions and chat endpoints share: checks that turn bad requests into HTTP 400s,
sampling parameters, tokenisation off the event loop, and running a ``Generation`` to a JSON
answer or a server-sent-event stream while watching for the client to go away.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ft.sampling_params import SamplingParams
from ft.scheduler.request import kv_tokens
from ft.server.detokenizer import TextOptions
from ft.server.engine_client import EngineClient, EngineDeadError, EngineRequestError
from ft.server.engine_process import EngineInfo
from ft.server.generation import Generation
from ft.server.metrics import Metrics
from ft.server.protocol import APIError
from ft.server.tokenizer import Tokenizer, TokenizerError


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer | None
    metrics: Metrics
    model_name: str
    max_waiting: int | None = None
    reasoning_parser: str | None = None  # ``--reasoning-parser``: chat answers split their reasoning
    # the checkpoint's sampling settings for fields a request leaves out (``ft.generation_config``)
    defaults: dict = field(default_factory=dict)

    @property
    def info(self) -> EngineInfo:
        return self.client.info

    # ---- checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(  # 404, as OpenAI and vLLM answer: clients catch it as NotFoundError
                404,
                f"model {name!r} is not served here (this server serves {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"token ids {bad[:5]} in {param} are outside the vocabulary [0, {vocab})", param=param
            )

    def check_prompt(
        self, ids: list[int], max_tokens: int, param: str = "prompt", limit: str = "max_tokens"
    ) -> None:
        """``param``: what the prompt came from (a chat's ``messages``), named when it is at fault;
        ``limit``: the field that gave ``max_tokens`` (a chat's ``max_completion_tokens``)."""
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        self.check_token_ids(ids, param)
        n, context, pool = len(ids), self.info.max_model_len, self.info.pool_tokens
        # a prompt no max_tokens makes fit: the prompt is at fault
        if n > context or (max_tokens and n == context):
            raise APIError(
                400,
                f"the prompt ({n} tokens) is longer than the model's context of {context} tokens"
                if n > context
                else f"the prompt ({n} tokens) fills the model's context of {context} tokens: "
                "no room to generate",
                param=param,
                code="context_length_exceeded",
            )
        if n > pool:
            raise APIError(
                400,
                f"the prompt ({n} tokens) is longer than this server's KV cache of {pool} tokens",
                param=param,
                code="context_length_exceeded",
            )
        total = n + max_tokens
        if total > context:
            raise APIError(
                400,
                f"prompt ({n} tokens) + {limit} ({max_tokens}) = {total} tokens exceeds the "
                f"model's context of {context} tokens",
                param=limit,
                code="context_length_exceeded",
            )
        kv = kv_tokens(n, max_tokens)
        if kv > pool:  # every token but a generated last one is cached
            raise APIError(
                400,
                f"prompt ({n} tokens) + {limit} ({max_tokens}) needs {kv} tokens of KV cache, "
                f"this server's holds {pool}",
                param=limit,
                code="context_length_exceeded",
            )

    # ---- tokenizer
    def need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(
                400, f"{what} needs a tokenizer and this checkpoint has none: send token ids", param="prompt"
            )
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tok = self.need_tokenizer("a text prompt")
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        tok = self.need_tokenizer("a chat")
        try:
            return await asyncio.to_thread(tok.chat_prompt, messages, add_generation_prompt, kwargs)
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from None

    # ---- generation
    def default(self, req, name: str):
        """``req``'s field ``name``, or the checkpoint's default where the request left it out."""
        if name in req.model_fields_set or name not in self.defaults:
            return getattr(req, name)
        return self.defaults[name]

    def chat_max_tokens(self, prompt_len: int) -> int:
        """A chat's max_tokens when it gives none: the rest of the context, or the checkpoint's
        max_new_tokens if less."""
        rest = max(1, self.info.max_request_tokens - prompt_len)
        return min(rest, self.defaults.get("max_tokens", rest))

    def sampling_params(
        self,
        req,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        limit: str = "max_tokens",
    ) -> SamplingParams:
        """``limit``: the field that gave ``max_tokens``, as ``check_prompt``'s."""
        if req.min_tokens > max_tokens:  # vLLM's rule; the engine would stop at max_tokens regardless
            message = f"min_tokens ({req.min_tokens}) is more than {limit} ({max_tokens})"
            raise APIError(400, message, param="min_tokens")
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        if self.tokenizer is None and any(req.stop_strings):  # no text to find them in
            message = "stop strings need a tokenizer and this checkpoint has none: use stop_token_ids"
            raise APIError(400, message, param="stop")
        vocab = self.info.vocab_size
        outside = [t for t in (req.logit_bias or {}) if int(t) >= vocab]
        if outside:
            raise APIError(
                400,
                f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.default(req, "temperature"),
                top_p=self.default(req, "top_p"),
                top_k=self.default(req, "top_k"),
                seed=req.seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                min_tokens=req.min_tokens,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=self.default(req, "repetition_penalty"),
                min_p=self.default(req, "min_p"),
                logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def generation(self, prefix: str, prompts: list[list[int]], params: SamplingParams, req) -> Generation:
        return Generation(
            self.client,
            self.tokenizer,
            self.metrics,
            f"{prefix}-{uuid.uuid4().hex}",
            prompts,
            params,
            req.n,
            TextOptions(tuple(req.stop_strings), req.include_stop_str_in_output, req.skip_special_tokens),
            self.max_waiting,
        )

    async def start(self, gen: Generation) -> None:
        try:
            await gen.start()
        except EngineRequestError as e:
            gen.close()
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(500, f"the engine has stopped: {e}", "server_error") from None
        except BaseException:
            gen.close()
            raise

    async def complete(self, request: Request, gen: Generation, body: Callable[[], dict]) -> Response:
        """Run to the end and answer with ``body()``; a client that leaves aborts the generation."""
        await self.start(gen)
        runner = asyncio.ensure_future(gen.run())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not runner.done():
                return Response(status_code=499)  # nobody is listening
            try:
                runner.result()
            except EngineDeadError as e:
                raise APIError(500, f"the engine has stopped: {e}", "server_error") from None
            # in a thread: an echoed long prompt's log-probs are a tokenizer call or two a token
            return JSONResponse(await asyncio.to_thread(body))
        finally:
            runner.cancel()
            watcher.cancel()
            gen.close()

    async def stream(self, request: Request, gen: Generation, events: AsyncIterator[dict]) -> Response:
        """Stream ``events`` as server-sent events ending in ``data: [DONE]``."""
        await self.start(gen)

        async def body():
            watcher = asyncio.ensure_future(_disconnected(request))
            watcher.add_done_callback(lambda _: gen.cancel())
            try:
                async for event in events:
                    yield sse(event)
            except EngineDeadError as e:
                yield sse(APIError(500, f"the engine has stopped: {e}", "server_error").body())
            finally:
                watcher.cancel()
            yield "data: [DONE]\n\n"

        return _Stream(
            gen,
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class _Stream(StreamingResponse):
    """A stream that closes its generation (aborts what still runs) however the response ends, not
    in its body: a client that leaves before the first chunk has the response cancelled before the
    body is iterated, so a ``finally`` there never runs and the engine would compute the whole
    answer for no one."""

    def __init__(self, gen: Generation, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(gen: Generation) -> dict:
    prompt, completion = gen.prompt_tokens, gen.completion_tokens
    cached = gen.cached_tokens
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
