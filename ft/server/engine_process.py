"""The engine process: an ``LLMEngine`` loop fed by the HTTP process over two queues.

The HTTP process (``ft.server.engine_client``) starts this process (spawned, not daemonic, so
that the engine may start its own tensor-parallel workers) and talks to it with messages:

    to the engine     ("add", batch, [(request_id, prompt_token_ids, SamplingParams), ...])
                      ("abort", [request_id, ...])      ("shutdown",)
    from the engine   ("ready", EngineInfo, stats)    ("ack", batch, error message or None)
                      ("step", [Delta, ...], stats)     ("stats", stats)    ("fatal", message)

The loop blocks on its queue only while it has nothing to run; otherwise it takes whatever has
arrived between two steps, so HTTP requests never wait on a step and a step never waits on HTTP.
Outputs leave as deltas (the tokens new since the last message), not cumulative lists. Every
step, and every batch of commands, ends with fresh stats for /metrics. This process ignores
SIGINT: a Ctrl-C reaches the whole process group, and the HTTP process owns the shutdown (a
message, or SIGTERM when the engine is still loading).
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import time
import traceback
from dataclasses import dataclass

from ft.config import EngineConfig
from ft.sampling_params import Logprobs, RequestOutput

IDLE_POLL_S = 1.0  # how often an idle engine checks that the HTTP process and its ranks are still there
MOE_LOG_S = 30.0  # how often the server log gets the offload figures (residency, hit rate, PCIe)
STALL_WAIT_S = 0.01  # how long a step that ran nothing waits for a command before trying again


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs to know about the engine, sent once when it is ready."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    num_slots: int
    weight_bytes: int
    kv_bytes: int
    state_bytes: int
    tp_size: int
    device: str
    dtype: str

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus generated tokens any request may have (what /v1/models advertises): the
        context, or the pool, the less. (A request that generates holds all but its last token
        in the pool, so one more fits it: ``ServerState.check_prompt``.)"""
        return min(self.max_model_len, self.pool_tokens)


@dataclass
class Delta:
    request_id: str
    token_ids: list[int]  # new since the last delta
    logprobs: list[Logprobs] | None  # one per new token, when asked for
    prompt_logprobs: list[Logprobs | None] | None  # once, when the prompt's are all known
    finish_reason: str | None  # set on the last delta: "stop" | "length" | "abort"
    num_cached_tokens: int = 0


def engine_main(cfg: EngineConfig, in_q, out_q) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)  # unwinds, so the engine stops its workers on the way out
    try:
        from ft.engine.engine import LLMEngine

        engine = LLMEngine(cfg)
    except Exception as e:
        out_q.put(("fatal", f"the engine failed to start: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        loop = EngineLoop(engine, in_q, out_q)
        # with the first stats: /metrics has the pool and the experts' placement before any request
        out_q.put(("ready", _info(engine, cfg), loop._stats()))
        loop.run()
    except Exception as e:
        out_q.put(("fatal", f"the engine stopped: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        engine.shutdown()


def _exit(signum, frame) -> None:
    raise SystemExit(0)


def _info(engine, cfg: EngineConfig) -> EngineInfo:
    plan, mc = engine.plan, engine.model_config
    return EngineInfo(
        max_model_len=engine.max_model_len,
        vocab_size=mc.vocab_size,
        block_size=cfg.block_size,
        num_blocks=plan.num_blocks,
        num_slots=plan.num_slots,
        weight_bytes=plan.weight_bytes,
        kv_bytes=plan.kv_bytes,
        state_bytes=plan.state_bytes,
        tp_size=cfg.tp_size,
        device=str(cfg.resolved_device),
        dtype=str(cfg.torch_dtype(mc.dtype)).replace("torch.", ""),
    )


class EngineLoop:
    def __init__(self, engine, in_q, out_q) -> None:
        self.engine, self.in_q, self.out_q = engine, in_q, out_q
        self.sent: dict[str, tuple[int, bool]] = {}  # request id -> (tokens sent, prompt log-probs sent)
        self.moe_logged = time.monotonic()

    def run(self) -> None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        stalled = False  # the last step ran nothing (requests wait for room): do not spin
        while True:
            busy = self.engine.has_unfinished_requests()
            wait = IDLE_POLL_S if not busy else STALL_WAIT_S if stalled else None
            try:
                commands = self._receive(wait)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # the HTTP process is gone: nobody to serve
                if not busy:
                    self.engine.check_workers()  # a rank that died meanwhile ends the loop (fatal)
                    continue
                commands = []
            for cmd in commands:
                if cmd[0] == "shutdown":
                    return
                self._handle(cmd)
            active = self.engine.has_unfinished_requests()
            if active:
                outputs = self.engine.step()
                stalled = not outputs
                if outputs or commands:
                    self.out_q.put(("step", [self._delta(o) for o in outputs], self._stats()))
            elif commands:
                self.out_q.put(("stats", self._stats()))
            if (busy or active) and not self.engine.has_unfinished_requests():  # the outputs are out
                self.engine.idle()

    def _receive(self, timeout: float | None) -> list:
        """Every command waiting; with a timeout, wait that long for the first (queue.Empty if none)."""
        commands = [] if timeout is None else [self.in_q.get(timeout=timeout)]
        while True:
            try:
                commands.append(self.in_q.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, batch, requests = cmd
            added = []
            try:
                for rid, prompt, params in requests:
                    self.engine.add_request(prompt, params, rid)
                    added.append(rid)
                    self.sent[rid] = (0, False)
            except ValueError as e:
                for rid in added:  # a request is all its choices or none of them
                    self.engine.abort_request(rid)
                    self.sent.pop(rid, None)
                self.out_q.put(("ack", batch, str(e)))
                return
            self.out_q.put(("ack", batch, None))
        elif cmd[0] == "abort":
            for rid in cmd[1]:
                self.engine.abort_request(rid)
                self.sent.pop(rid, None)
        else:
            raise ValueError(f"engine process: unknown command {cmd[0]!r}")

    def _delta(self, out: RequestOutput) -> Delta:
        n_sent, plp_sent = self.sent.get(out.request_id, (0, True))
        plp = None
        complete = out.prompt_logprobs is not None and (
            len(out.prompt_logprobs) == len(out.prompt_token_ids) or out.finished
        )
        if complete and not plp_sent:
            plp, plp_sent = out.prompt_logprobs, True
        if out.finished:
            self.sent.pop(out.request_id, None)
        else:
            self.sent[out.request_id] = (len(out.token_ids), plp_sent)
        return Delta(
            out.request_id,
            out.token_ids[n_sent:],
            out.logprobs[n_sent:] if out.logprobs is not None else None,
            plp,
            out.finish_reason if out.finished else None,
            out.num_cached_tokens,
        )

    def _stats(self) -> dict:
        s = self.engine.stats()
        self._log_moe(s)
        return dataclasses.asdict(s) | s.derived()

    def _log_moe(self, s) -> None:
        """Every ``MOE_LOG_S`` seconds while experts move, one line of the offload figures."""
        now = time.monotonic()
        if s.moe_backend == "gpu" or now - self.moe_logged < MOE_LOG_S:
            return
        self.moe_logged = now
        print(
            f"ft engine: moe {s.moe_backend}: residency {s.moe_residency:.1%}, hit rate "
            f"{s.moe_hit_rate:.1%}, {s.moe_bytes_per_token / 1e6:.2f} MB streamed per token, "
            f"PCIe {s.moe_pcie_gb_s:.1f} GB/s effective",
            flush=True,
        )
