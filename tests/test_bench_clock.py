"""``ft bench offline`` and ``ft bench serve`` print what docs/benchmarks.md's Method defines, checked
against an engine whose time is known.

Offline: the engine's executor is replaced by a device that runs no model and takes a set time for
each batch it is given, one batch after another (a prefill token 1 ms, a decode step 10 ms + 2 ms a
sequence), as a GPU runs what the host queued: a batch launched while the one before still runs
starts when it ends, so decode ahead gains nothing and must change no figure. It also counts, as an
offloading MoE backend would, expert uses and bytes over PCIe a token, and a prefill after
``engine.idle()`` takes half its time (experts pre-staged while idle). Every printed and saved figure
is then compared with the Method's formula over those times. Serve: a scripted engine answers each
request after a known prefill time, then a token every 10 ms, behind a real HTTP server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
import types

import numpy as np
import pytest

import ft.bench.offline as offline
from ft.cli import main
from ft.engine.model_runner import SeqResult
from ft.layers.sampler import SampleResult
from tests.checkpoints import write_checkpoint

PREFILL_S = 2.5e-3  # a prompt token
DECODE_S, DECODE_SEQ_S = 25e-3, 5e-3  # a decode step, and a sequence in it
HITS, MISSES, MISS_BYTES = 3, 1, 1_500_000  # a decoded token's expert uses; bytes over PCIe a miss
PREFILL_BYTES = 500_000  # over PCIe a prompt token


def decode_s(batch: int) -> float:
    return DECODE_S + DECODE_SEQ_S * batch


def near(seconds_or_rate: float):
    """Within 6%: a busy host's sleeps overshoot (and without decode ahead each step's add up)."""
    return pytest.approx(seconds_or_rate, rel=0.06)


class ClockDevice:
    """The executor's interface over a serial clock: ``launch`` queues a batch behind the last,
    ``collect`` returns its (constant) tokens once the clock says it has run."""

    def __init__(self, inner) -> None:
        self.inner, self.plan = inner, inner.plan
        self.free = 0.0  # when the batches launched so far have all run
        self.prestaged = False
        self.counts = dict(moe_hits=0, moe_misses=0, moe_bytes_h2d=0, moe_tokens=0, moe_prestaged_layers=0)

    def launch(self, seqs, ids_from=None):
        prompt = sum(len(s.token_ids) for s in seqs if len(s.token_ids) > 1)
        decoding = sum(len(s.token_ids) == 1 for s in seqs)
        cost = prompt * PREFILL_S + (decode_s(decoding) if decoding else 0.0)
        if prompt and self.prestaged:
            cost, self.prestaged = cost / 2, False
            self.counts["moe_prestaged_layers"] += 1
        self.free = max(time.perf_counter(), self.free) + cost
        c = self.counts
        c["moe_hits"] += HITS * decoding
        c["moe_misses"] += MISSES * decoding
        c["moe_bytes_h2d"] += MISS_BYTES * MISSES * decoding + PREFILL_BYTES * prompt
        c["moe_tokens"] += prompt + decoding
        return types.SimpleNamespace(seqs=seqs, done=self.free)

    def collect(self, launched):
        time.sleep(max(0.0, launched.done - time.perf_counter()))
        seqs = launched.seqs
        return [SeqResult(s.request_id, SampleResult(7, None) if s.sample else None, None) for s in seqs]

    def execute(self, seqs):
        return self.collect(self.launch(seqs))

    def runs_unattended(self, tokens: int) -> bool:
        return True

    def moe_stats(self) -> dict:
        return {"moe_backend": "offload"} | self.counts

    def moe_idle(self) -> None:
        self.prestaged = True

    def flush_moe(self) -> None:
        pass

    def set_moe_variant(self, policy, routing_skew) -> None:
        pass

    def shutdown(self) -> None:
        self.inner.shutdown()


@pytest.mark.parametrize("ahead", ["--decode-ahead", "--no-decode-ahead"])
def test_bench_offline_figures_are_the_methods_formulas(tmp_path, monkeypatch, capsys, ahead):
    real = offline.LLMEngine

    def on_the_clock(cfg):
        engine = real(cfg)
        engine.executor = ClockDevice(engine.executor)
        moe = dataclasses.replace(engine.plan.moe, backend="offload")  # stats come from the device
        engine.plan = dataclasses.replace(engine.plan, moe=moe)
        return engine

    monkeypatch.setattr(offline, "LLMEngine", on_the_clock)
    monkeypatch.setattr(offline, "measure_bandwidth", lambda device: 100e9)
    monkeypatch.setattr(offline, "measure_matmul_rate", lambda device: 1e12)
    write_checkpoint(tmp_path, "qwen3_next")
    out_json = tmp_path / "bench.json"
    argv = ["bench", "offline", "--config", str(tmp_path / "config.json"), "--load-format", "dummy"]
    argv += ["--device", "cpu", "--batch-sizes", "1,3", "--input-len", "64", "--output-len", "16", ahead]
    argv += ["--prefill-lens", "96", "--ttft-idle-s", "0.05", "--output-json", str(out_json)]
    assert main(argv) == 0
    printed, r = capsys.readouterr().out, json.loads(out_json.read_text())
    inp, out = 64, 16

    # TTFT: a prompt -> 1 token after the idle spell (excluded), its prefill pre-staged: half the time
    ttft_ms = 1e3 * inp * PREFILL_S / 2
    assert r["ttft_ms"] == near(ttft_ms) and r["ttft_ms"] == sorted(r["ttft_runs_ms"])[2]
    assert all(ttft_ms <= t < 1.5 * ttft_ms for t in r["ttft_runs_ms"])  # no run is faster than the clock
    assert r["ttft_prestaged_layers"] == [1] * 5
    # single stream: output_len over its own run's time after its first token (a full prefill: no
    # idle before it), not over that time after the TTFT above (it would be 14% lower)
    assert r["single_stream_tok_s"] == near(1 / decode_s(1))
    for row in r["rows"]:
        n = row["batch"]
        wall = n * inp * PREFILL_S + (out - 1) * decode_s(n)  # one prefill chunk, then out - 1 steps
        assert row["wall_s"] == near(wall)
        assert row["aggregate_tok_s"] == near(n * out / wall)
        assert row["decode_tok_s"] == near(n / decode_s(n))
        assert row["roofline_tok_s"] == pytest.approx(n / (row["step_gb"] * 1e9 / 100e9))
        assert row["ratio"] == pytest.approx(row["decode_tok_s"] / row["roofline_tok_s"])
        # the decode steps' window only: no prefill bytes in it
        assert row["moe_hit_rate"] == HITS / (HITS + MISSES)
        assert row["moe_mb_per_token"] == pytest.approx(MISSES * MISS_BYTES / 1e6)
    assert r["prefill"]["96"] == near(1 / PREFILL_S)
    assert r["prefill_streamed"]["96"] == 96 * PREFILL_BYTES
    assert r["hbm_gb_s"] == 100 and r["matmul_tflops"] == 1
    # the printed lines are the saved figures, in their units
    rate = r["prefill"]["96"]
    assert f"prefill 96 tokens: {rate:,.0f} tok/s, first token in {96 / rate:,.2f} s" in printed
    assert f"streamed 48.000 MB at {96 * PREFILL_BYTES / (96 / rate) / 1e9:,.1f} GB/s" in printed
    assert f"TTFT: {r['ttft_ms']:,.1f} ms" in printed and "measured memory bandwidth 100 GB/s" in printed
    assert f"{r['rows'][1]['decode_tok_s']:>13,.1f}" in printed
    assert f"decode hit rate 75.0%, {MISSES * MISS_BYTES / 1e6:,.2f} MB over PCIe per token" in printed


BENCH_PREFILL_S = [0.04 + 0.01 * i for i in range(8)]  # the i-th request to arrive
BENCH_OUT = 6


@pytest.fixture
def timed_server():
    """A real HTTP server (uvicorn, in a thread) over a scripted engine with known times."""
    import uvicorn

    from ft.server.app import build_app
    from ft.server.engine_process import Delta
    from ft.server.metrics import Metrics
    from ft.server.serving import ServerState
    from tests.server import scripted

    class Timed(scripted.ScriptedEngine):
        arrived = in_flight = most_in_flight = 0

        async def _run(self, rid, prompt, params, sink) -> None:
            wait, Timed.arrived = BENCH_PREFILL_S[Timed.arrived], Timed.arrived + 1
            Timed.in_flight += 1
            Timed.most_in_flight = max(Timed.most_in_flight, Timed.in_flight)
            for i in range(params.max_tokens):
                await asyncio.sleep(wait if i == 0 else DECODE_S)
                last = i + 1 == params.max_tokens
                Timed.in_flight -= last
                sink.put_nowait(Delta(rid, [5], None, None, "length" if last else None))

    engine = Timed(lambda prompt: [5])
    state = ServerState(engine, scripted.tokenizer(), Metrics(scripted.MODEL, lambda: {}), scripted.MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", Timed
    server.should_exit = True
    thread.join()


def test_bench_serve_times_each_stream_on_the_clients_clock(timed_server):
    """TTFT from sending to the first streamed token, gaps between tokens, end to end, with four
    requests in flight: each within a few ms of the engine's known times (HTTP adds a little)."""
    from ft.bench.serve import BenchConfig, format_report, run

    url, engine = timed_server
    cfg = BenchConfig(base_url=url, num_prompts=8, concurrency=4, input_len=8, output_len=BENCH_OUT)
    r = asyncio.run(run(cfg))
    assert r["completed"] == 8 and r["output_tokens"] == 8 * BENCH_OUT and engine.most_in_flight == 4

    def over(got: dict, want: list[float], late: float, early: float = 0.0, tail: float = 0.0) -> None:
        """``got``'s mean and percentiles those of ``want``, up to ``late`` later (p90 and p99: up to
        ``tail`` more: one slow wake-up of a busy host's) or ``early`` earlier."""
        expected = {"mean": np.mean(want)} | {f"p{q}": np.percentile(want, q) for q in (50, 90, 99)}
        for k, v in expected.items():
            slack = late + (tail if k in ("p90", "p99") else 0.0)
            assert v - early <= got[k] < v + slack, (k, got[k], v)

    over(r["ttft_s"], BENCH_PREFILL_S, late=0.02, tail=0.03)  # a 30 ms lateness is caught
    # a chunk that arrives late makes the gap after it short
    over(r["itl_s"], [DECODE_S] * 8 * (BENCH_OUT - 1), late=0.008, early=0.002, tail=0.015)
    e2e = [p + (BENCH_OUT - 1) * DECODE_S for p in BENCH_PREFILL_S]
    over(r["e2e_s"], e2e, late=0.025, tail=0.03)
    # four at a time: the next request starts as the first of those in flight ends
    ends = sorted(e2e[:4])
    last = max(a + b for a, b in zip(ends, e2e[4:]))
    assert last <= r["duration_s"] < last + 0.05
    assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
    printed = format_report(r)
    assert f"TTFT{1e3 * r['ttft_s']['mean']:>19.1f}{1e3 * r['ttft_s']['p50']:9.1f}" in printed
