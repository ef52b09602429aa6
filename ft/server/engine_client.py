"""The HTTP process's handle on the engine process.

``spawn()`` starts the engine process and ``wait_ready()`` blocks until its model is loaded (both
before the event loop runs); ``attach(loop)`` then starts one reader thread that hands every
message from the engine to the event loop with ``call_soon_threadsafe``. Handlers never block:
``add`` puts on a ``multiprocessing.Queue`` (a feeder thread does the pickling and writing) and
awaits the engine's acknowledgement; outputs arrive in the asyncio queue the handler registered.

It also keeps what /metrics and the admission check need: the engine's latest stats, the
requests not yet scheduled (the waiting queue), and first-token and inter-token latencies.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable

from ft.config import EngineConfig
from ft.sampling_params import SamplingParams
from ft.server.engine_process import Delta, EngineInfo, engine_main


class EngineDeadError(RuntimeError):
    """The engine process failed; nothing more will be served (HTTP 500)."""


class EngineRequestError(ValueError):
    """The engine refused a request (too long for the context or the pool, bad token ids): HTTP 400."""


class EngineClient:
    def __init__(self, cfg: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        self._in_q, self._out_q = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=engine_main, args=(cfg, self._in_q, self._out_q), name="ft-engine", daemon=False
        )
        self.info: EngineInfo | None = None
        self.stats: dict = {}
        self.dead: str | None = None  # why the engine stopped, once it has
        self.on_fatal: Callable[[str], None] | None = None
        self.on_first_token: Callable[[float], None] | None = None
        self.on_token_gap: Callable[[float], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._batches = itertools.count()
        self._acks: dict[int, asyncio.Future] = {}
        self._sinks: dict[str, asyncio.Queue] = {}  # request id -> its handler's queue
        self._unscheduled: set[str] = set()
        self._times: dict[str, list[float | None]] = {}  # request id -> [arrival, last token]

    # ---- life cycle (blocking; outside the event loop)
    def spawn(self) -> None:
        self.proc.start()

    def wait_ready(self, timeout_s: float | None = None) -> EngineInfo:
        """Block until the engine has loaded its model; EngineDeadError if it failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                msg = self._out_q.get(timeout=0.5)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise EngineDeadError(f"the engine process exited (code {self.proc.exitcode})") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineDeadError(f"the engine was not ready after {timeout_s} s") from None
                continue
            if msg[0] == "fatal":
                raise EngineDeadError(msg[1])
            if msg[0] == "ready":
                self.info, self.stats = msg[1], msg[2]
                return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = threading.Thread(target=self._read, name="ft-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout_s: float = 15.0) -> None:
        """Stop the engine process (and so its workers); safe to call more than once."""
        if self._stopping:
            return
        self._stopping = True
        if self.proc.is_alive() and self.info is not None:
            self._in_q.put(("shutdown",))
            self.proc.join(timeout_s)
        if self.proc.is_alive():  # still loading (or stuck): SIGTERM unwinds it
            self.proc.terminate()
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self._reader is not None:
            self._reader.join(2)
        for q in (self._in_q, self._out_q):
            q.cancel_join_thread()
            q.close()

    # ---- requests (event loop)
    @property
    def num_unscheduled(self) -> int:
        """Requests sent to the engine that it has not started yet."""
        return len(self._unscheduled)

    async def add(
        self, requests: list[tuple[str, list[int], SamplingParams]], sink: asyncio.Queue, arrival: float
    ) -> None:
        """Send requests (one HTTP request's choices); their Deltas will go to ``sink``."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        batch = next(self._batches)
        ack = self._loop.create_future()
        self._acks[batch] = ack
        for rid, _, _ in requests:
            self._sinks[rid] = sink
            self._unscheduled.add(rid)
            self._times[rid] = [arrival, None]
        self._in_q.put(("add", batch, requests))
        error = await ack
        if error is not None:
            self._forget([rid for rid, _, _ in requests])
            raise EngineRequestError(error)

    def release(self, request_ids: list[str]) -> None:
        """The handler is done with these requests: abort those the engine still runs."""
        live = [rid for rid in request_ids if rid in self._sinks]
        self._forget(live)
        if live and self.dead is None and not self._stopping:
            self._in_q.put(("abort", live))

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sinks.pop(rid, None)
            self._unscheduled.discard(rid)
            self._times.pop(rid, None)

    # ---- messages from the engine
    def _read(self) -> None:
        while not self._stopping:
            try:
                msg = self._out_q.get(timeout=0.5)
            except queue.Empty:
                if self.proc.is_alive() or self._stopping:
                    continue
                msg = ("fatal", f"the engine process exited unexpectedly (code {self.proc.exitcode})")
            except (EOFError, OSError):
                return
            self._loop.call_soon_threadsafe(self._on_message, msg)
            if msg[0] == "fatal":
                return

    def _on_message(self, msg) -> None:
        kind = msg[0]
        if kind == "step":
            now = time.monotonic()
            for delta in msg[1]:
                self._on_delta(delta, now)
            self.stats = msg[2]
        elif kind == "stats":
            self.stats = msg[1]
        elif kind == "ack":
            fut = self._acks.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "fatal":
            self._on_fatal(msg[1])

    def _on_delta(self, delta: Delta, now: float) -> None:
        rid = delta.request_id
        sink = self._sinks.get(rid)
        if sink is None:
            return  # released by its handler; an abort is on its way
        self._unscheduled.discard(rid)
        times = self._times[rid]
        if delta.token_ids:
            if times[1] is None:
                if self.on_first_token is not None:
                    self.on_first_token(now - times[0])
            elif self.on_token_gap is not None:
                self.on_token_gap((now - times[1]) / len(delta.token_ids))
            times[1] = now
        if delta.finish_reason is not None:
            self._forget([rid])
        sink.put_nowait(delta)

    def _on_fatal(self, why: str) -> None:
        if self.dead is not None or self._stopping:
            return
        self.dead = why
        err = EngineDeadError(why)
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(err)
        for sink in set(self._sinks.values()):
            sink.put_nowait(err)
        self._acks.clear()
        self._forget(list(self._sinks))
        if self.on_fatal is not None:
            self.on_fatal(why)
