"""A streamed answer whose client leaves before its first chunk still aborts its generation: the
response's body (whose ``finally`` closes it) may never be iterated."""

from __future__ import annotations

import asyncio

from ft.server.serving import ServerState


class _Gen:
    """The parts of ``Generation`` a stream touches, counting what it was asked."""

    def __init__(self) -> None:
        self.started = self.closed = 0

    async def start(self) -> None:
        self.started += 1

    def close(self) -> None:
        self.closed += 1

    def cancel(self) -> None:
        self.close()


async def _never():
    await asyncio.Event().wait()  # no event ever comes: the engine still computes
    yield {}


def _leave_before_first_chunk(spec_version: str) -> _Gen:
    gen = _Gen()

    async def main():
        state = ServerState.__new__(ServerState)
        response = await state.stream(None, gen, _never())

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):  # the client is gone: the response's first send never completes
            await asyncio.Event().wait()

        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        await asyncio.wait_for(response(scope, receive, send), 0.5)

    try:
        asyncio.run(main())
    except (asyncio.TimeoutError, OSError):
        pass
    return gen


def test_a_client_gone_before_the_first_chunk_aborts_the_generation():
    for spec in ("2.3", "2.4"):  # starlette listens for the disconnect, or learns of it from send
        gen = _leave_before_first_chunk(spec)
        assert gen.started == 1 and gen.closed >= 1, spec
