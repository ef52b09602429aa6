"""Executors run the model runners of all ranks.

- ``InProcessExecutor``: tp_size 1, the runner lives in the caller's process.
- ``MultiprocExecutor``: one child process per rank (rank 0 included), joined by
  torch.distributed (NCCL on CUDA, gloo on CPU). The caller sends each step to every rank over
  its pipe and reads rank 0's result. It waits on *every* rank's pipe and sentinel, so a rank
  that raises or dies is noticed at once: the others are killed and the caller gets
  ``WorkerError``, naming the rank that failed first, instead of hanging in a collective.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait

import torch

from ft.config import EngineConfig
from ft.distributed import TPInfo, init_process_group, local_threads_for
from ft.models.config import ModelConfig


class WorkerError(RuntimeError):
    """A tensor-parallel rank died or raised; the engine cannot continue."""


class InProcessExecutor:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig) -> None:
        from ft.engine.model_runner import ModelRunner

        self.runner = ModelRunner(cfg, mc, TPInfo(0, 1))
        self.plan = self.runner.plan

    def execute(self, seqs):
        return self.runner.execute(seqs)

    def launch(self, seqs, ids_from=None):
        return self.runner.launch(seqs, ids_from)

    def runs_unattended(self, tokens: int) -> bool:
        return self.runner.moe.runs_unattended(tokens)

    def collect(self, launched):
        return self.runner.collect(launched)

    def moe_stats(self) -> dict:
        return self.runner.moe.stats()

    def flush_moe(self) -> None:
        self.runner.moe.flush()

    def moe_idle(self) -> None:
        self.runner.moe.idle()

    def check(self) -> None:
        """Nothing to watch: the model runs in this process."""

    def set_moe_variant(self, policy: str | None, routing_skew: float | None) -> None:
        self.runner.set_moe_variant(policy, routing_skew)

    def profile(self, action: str, calls: list | None = None) -> dict | float | None:
        return self.runner.profile(action, calls)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.runner = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, cfg: EngineConfig, mc: ModelConfig, init_method: str, conn: Connection) -> None:
    try:
        from ft.engine.model_runner import ModelRunner

        torch.set_num_threads(local_threads_for(cfg.tp_size))
        device = cfg.resolved_device
        if device.type == "cuda":
            device = torch.device("cuda", rank)
        tp = init_process_group(rank, cfg.tp_size, init_method, device, cfg.dist_timeout_s)
        runner = ModelRunner(cfg, mc, tp)
        conn.send(("ready", runner.plan))
        launched = collections.deque()  # batches launched and not yet collected (decode ahead)
        while True:
            cmd, payload = conn.recv()
            if cmd == "shutdown":
                break
            if cmd == "moe_stats":  # asked of the first rank only
                conn.send(("ok", runner.moe.stats()))
                continue
            if cmd == "moe_variant":  # every rank switches, so all keep routing alike
                runner.set_moe_variant(*payload)
                conn.send(("ok", None))
                continue
            if cmd == "moe_flush":  # every rank, so all promote the same experts at the same step
                runner.moe.flush()
                conn.send(("ok", None))
                continue
            if cmd == "moe_idle":  # every rank stages its own shard of the same experts
                runner.moe.idle()
                conn.send(("ok", None))
                continue
            if cmd == "profile":  # every rank alike (eager steps, timed all-reduces); the first answers
                conn.send(("ok", runner.profile(*payload)))
                continue
            if cmd == "launch":  # payload: the batch, and whether its ids are the last batch's samples
                seqs, ahead = payload
                launched.append(runner.launch(seqs, launched[-1] if ahead else None))
                continue
            result = runner.collect(launched.popleft()) if cmd == "collect" else runner.execute(payload)
            if rank == 0:
                conn.send(("ok", result))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:  # report, then die: the caller turns this into WorkerError
        try:  # when: the caller reports the first error, not its echoes on the other ranks
            why = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            conn.send(("error", (time.time(), why)))
        except Exception:
            pass
        os._exit(1)
    finally:
        conn.close()


class MultiprocExecutor:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns: list[Connection] = []
        self.procs = []
        self.inbox = [collections.deque() for _ in range(cfg.tp_size)]  # messages read, not yet asked for
        self.gone: set[int] = set()  # ranks that died or closed their pipe
        for rank in range(cfg.tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, cfg, mc, init_method, child),
                daemon=True,
                name=f"ft-rank{rank}",
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        plans = [self._recv(i, "ready") for i in range(cfg.tp_size)]
        self.plan = plans[0]

    def _recv(self, rank: int, expect: str):
        """The next message of ``rank``. Every rank's pipe is read meanwhile, not only ``rank``'s:
        another rank's error fails the call as it comes (one larger than a pipe holds would block
        that rank, and the collective waiting for it, until the timeout), as a death does."""
        while not self.inbox[rank]:
            self._check(None)
        kind, payload = self.inbox[rank].popleft()
        if kind != expect:
            self._fail(f"rank {rank} sent {kind!r}, expected {expect!r}")
        return payload

    def _check(self, timeout: float | None) -> None:
        """Read what the ranks sent within ``timeout`` (None: until something comes); fail the
        group (``WorkerError``) if a rank has failed."""
        if self._read(self._watched(timeout)):
            self._fail(self._cause())

    def _watched(self, timeout: float | None = None) -> list:
        """Those of the live ranks' pipes and sentinels that are ready (``wait``)."""
        live = [i for i in range(len(self.procs)) if i not in self.gone]
        return wait([self.conns[i] for i in live] + [self.procs[i].sentinel for i in live], timeout)

    def _read(self, ready: list) -> bool:
        """Take the messages in ``ready`` into the inboxes (all that an exited rank left); whether
        a rank has failed: sent an error, closed its pipe or died."""
        failed = False
        for i, (conn, p) in enumerate(zip(self.conns, self.procs)):
            if p.sentinel in ready:
                self.gone.add(i)
            if conn not in ready and i not in self.gone:
                continue
            try:
                while conn.poll():
                    self.inbox[i].append(conn.recv())
                    failed |= self.inbox[i][-1][0] == "error"
                    if i not in self.gone:  # one at a time from a live rank
                        break
            except (EOFError, OSError):
                self.gone.add(i)
        return failed or bool(self.gone)

    def _cause(self) -> str:
        """What broke the group, once every rank has failed or a second has passed: a rank that
        died without a word (killed), else the error raised first. The others' errors are mostly
        its echoes (collectives that lost a peer), raised after it but not always read after it."""
        deadline = time.monotonic() + 1.0
        while (left := deadline - time.monotonic()) > 0 and not all(
            i in self.gone or self._error(i) for i in range(len(self.procs))
        ):
            self._read(self._watched(left))
        for i in sorted(self.gone):
            if self._error(i) is None:
                self.procs[i].join(timeout=5)
                return f"tensor-parallel rank {i} died (exit code {self.procs[i].exitcode})"
        return min(e for e in map(self._error, range(len(self.procs))) if e is not None)[1]

    def _error(self, rank: int) -> tuple[float, str] | None:
        """(when, why) of the error ``rank`` sent, if it sent one."""
        return next((payload for kind, payload in self.inbox[rank] if kind == "error"), None)

    def _fail(self, why: str):
        self.shutdown(graceful=False)
        raise WorkerError(why)

    def execute(self, seqs):
        self._send_all("execute", seqs)
        return self._recv(0, "ok")

    def launch(self, seqs, ids_from=None) -> list:
        """Every rank launches the batch (``ids_from``: not None when its ids are the samples of
        the batch launched just before); nothing comes back until ``collect``. The handle
        returned is the batch itself: the ranks keep what they launched, in order."""
        self._send_all("launch", (seqs, ids_from is not None))
        return seqs

    def runs_unattended(self, tokens: int) -> bool:
        """``MoeRuntime.runs_unattended`` as the ranks reported it at start-up (``MoePlan``)."""
        moe = self.plan.moe
        return moe is None or moe.unattended_tokens is None or tokens <= moe.unattended_tokens

    def collect(self, launched=None):
        """The first rank's results of the oldest batch launched and not yet collected."""
        self._send_all("collect", None)
        return self._recv(0, "ok")

    def _send_all(self, cmd: str, payload) -> None:
        for conn in self.conns:
            try:
                conn.send((cmd, payload))
            except (BrokenPipeError, OSError):
                self._recv(0, "ok")  # surfaces which rank died

    def moe_stats(self) -> dict:
        """The first rank's MoE placement counters (every rank routes alike; bytes are per rank)."""
        try:
            self.conns[0].send(("moe_stats", None))
        except (BrokenPipeError, OSError):
            pass
        return self._recv(0, "ok")

    def set_moe_variant(self, policy: str | None, routing_skew: float | None) -> None:
        self._every_rank("moe_variant", (policy, routing_skew))

    def flush_moe(self) -> None:
        self._every_rank("moe_flush", None)

    def moe_idle(self) -> None:
        self._every_rank("moe_idle", None)

    def profile(self, action: str, calls: list | None = None) -> dict | float | None:
        """``ModelRunner.profile`` on every rank; the first rank's result."""
        return self._every_rank("profile", (action, calls))[0]

    def check(self) -> None:
        """Raise ``WorkerError`` if a rank has died or sent an error since the last call, without
        waiting: an idle server asks every second, so a rank killed while no request runs stops it
        then (its supervisor restarts it) instead of failing the next request."""
        if self.procs:
            self._check(0)

    def _every_rank(self, cmd: str, payload) -> list:
        for conn in self.conns:
            try:
                conn.send((cmd, payload))
            except (BrokenPipeError, OSError):
                pass  # a dead rank: ``_recv`` reports which, with its exit code
        return [self._recv(rank, "ok") for rank in range(len(self.conns))]

    def shutdown(self, graceful: bool = True) -> None:
        for conn in self.conns:
            try:
                if graceful:
                    conn.send(("shutdown", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def make_executor(cfg: EngineConfig, mc: ModelConfig):
    return InProcessExecutor(cfg, mc) if cfg.tp_size == 1 else MultiprocExecutor(cfg, mc)
