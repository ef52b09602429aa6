"""CPU time the server's processes spend per streamed token, on the CPU (not a test; prints a table).
``python tests/server_costs.py [CONCURRENCY ...]``

A real ``ft serve`` on a tiny random checkpoint (float32 on the CPU, one thread a process, as the
server tests run it) takes ``ft bench serve``'s load: streamed completions of 128 tokens, C at a
time. The HTTP process's and the engine process's CPU seconds over the run (``/proc/PID/stat``),
divided by the tokens streamed, give each one's cost a token: what bounds the server's tokens a
second on one core whatever the GPU does (1 s / that cost). The engine's figure here is mostly the
tiny model's CPU forward; on a GPU its host work is the scheduler's and the runner's.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ft.bench.serve import BenchConfig, run  # noqa: E402
from tests.server.harness import make_model_dir, start_server  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def measure(server, concurrency: int, prompts: int, output_len: int) -> dict:
    engine = server.descendants()
    cfg = BenchConfig(
        base_url=server.url, num_prompts=prompts, concurrency=concurrency, input_len=16, output_len=output_len
    )
    asyncio.run(run(BenchConfig(**{**cfg.__dict__, "num_prompts": concurrency})))  # warm up
    before = cpu_seconds(server.proc.pid), sum(cpu_seconds(p) for p in engine)
    t = time.perf_counter()
    result = asyncio.run(run(cfg))
    wall = time.perf_counter() - t
    http, eng = cpu_seconds(server.proc.pid) - before[0], sum(cpu_seconds(p) for p in engine) - before[1]
    tokens = result["output_tokens"]
    return dict(c=concurrency, tokens=tokens, wall=wall, http_us=http / tokens * 1e6,
                engine_us=eng / tokens * 1e6, failed=result.get("failed", 0))  # fmt: skip


def main() -> None:
    levels = [int(a) for a in sys.argv[1:]] or [1, 16, 64]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp) / "model")
        server = start_server(model, Path(tmp) / "server.log", "--max-running-requests", str(max(levels)))
        try:
            rows = [measure(server, c, max(4 * c, 16), 128) for c in levels]
        finally:
            server.stop()
    print("| concurrency | tokens | wall s | tok/s | HTTP process µs CPU a token | engine µs CPU a token |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['c']} | {r['tokens']} | {r['wall']:.1f} | {r['tokens'] / r['wall']:.0f} | "
            f"{r['http_us']:.0f} | {r['engine_us']:.0f} |" + (f" {r['failed']} failed" if r["failed"] else "")
        )


if __name__ == "__main__":
    main()
