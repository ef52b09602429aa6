"""The FastAPI application: routes, the API-key and body-size guards, and error bodies.

Every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with its HTTP
status (400 bad request, 401 key, 404 unknown route or model, 405 method, 413 body too large, 503
queue full, 500 engine failure), and the server keeps serving. The engine lives in another process
(``ft.server.engine_client``); this module only routes and guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ft.server.chat import create_chat_completion
from ft.server.completions import create_completion
from ft.server.metrics import CONTENT_TYPE
from ft.server.protocol import APIError
from ft.server.serving import ServerState
from ft.server.tokens import detokenize, tokenize

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024


def build_app(
    state: ServerState, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        state.client.attach(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(state.client.shutdown)

    app = FastAPI(title="ft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ft = state
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(e.status_code, str(e.detail), kind).body(),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _server_error(_request: Request, e: Exception) -> Response:
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", "server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if state.client.dead is not None:
            return JSONResponse({"status": "engine stopped", "error": state.client.dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        info = state.info
        card = {
            "id": state.model_name,
            "object": "model",
            "created": created,
            "owned_by": "ft",
            "max_model_len": info.max_request_tokens,
            "vocab_size": info.vocab_size,
        }
        return JSONResponse({"object": "list", "data": [card]})

    posts = {
        "/v1/completions": create_completion,
        "/v1/chat/completions": create_chat_completion,
        "/tokenize": tokenize,
        "/detokenize": detokenize,
    }
    for path, handle in posts.items():
        app.add_api_route(path, _post_route(state, handle), methods=["POST"])

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKey, key=api_key)
    return app


def _post_route(state: ServerState, handle):
    """A POST route's endpoint: ``handle(state, request)`` (a closure: FastAPI reads an endpoint's
    parameters as the request's)."""

    async def route(request: Request) -> Response:
        return await handle(state, request)

    return route


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class APIKey:
    """``Authorization: Bearer KEY`` on every route but /health and /metrics (probes, scrapers)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                why = "a wrong API key" if given else "no API key"
                await _send_error(
                    send,
                    APIError(
                        401,
                        f"request has {why}: send 'Authorization: Bearer KEY'",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    ),
                )
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413, by Content-Length or while reading."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> APIError:
        return APIError(
            413,
            f"the request body exceeds this server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, self._error())
            return
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()  # becomes a 413 answer in the APIError handler
            return message

        await self.app(scope, limited, send)


class Server(uvicorn.Server):
    """uvicorn's server, except that a signal that asked for shutdown is not raised again once it
    is done (uvicorn re-raises it, which would end ``ft serve`` before it has stopped the engine)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
