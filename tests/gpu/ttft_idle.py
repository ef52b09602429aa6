"""TTFT of a 1k prompt that finds an offloading engine idle, pre-staging off and on, one load (not a test):

    python tests/gpu/ttft_idle.py CONFIG [RATIO] [OUT.log]        # DEV=cpu: a CPU dry run

Loads CONFIG (dummy weights, the offload backend at ``--memory-ratio`` RATIO, default 0.94, 8
request slots, 40k KV tokens), warms up, then times rounds of five 1,024-token prompts -> one
token, pre-staging (``staging.PRESTAGE``, read at each ``LLMEngine.idle``) off and on, rounds by
ROUNDS.
Before each prompt the engine is idle for a second: ``engine.idle()`` (its host time), the
device synchronised (when its copies landed), the rest of the second slept. Each prompt's line
gives the step that computed it (the prefill and its token, device synchronised) and the
pre-staged layers it computed. A round's staged buffers are dropped before the next round.
``ft bench offline --ttft-idle-s`` measures one setting a load; this measures both on one."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.bench.offline import idle_for, run_batch  # noqa: E402
from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.moe.backends import staging  # noqa: E402
from tests.gpu.profiling import log_medians, logger  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
IDLE_S = 1.0
PROMPT = 1024
# rounds of five prompts, pre-staging off or on
ROUNDS = os.environ.get("ROUNDS", "off,on,off,on").split(",")


def main() -> None:
    src = sys.argv[1]
    ratio = float(sys.argv[2]) if len(sys.argv) > 2 else 0.94
    log = logger(sys.argv[3] if len(sys.argv) > 3 else None)
    t0 = time.perf_counter()
    cfg = EngineConfig(
        config_file=src, load_format="dummy", device=DEV, moe_backend="offload", memory_ratio=ratio,
        max_running_requests=8, num_tokens=40000, progress=False,
        **({"expert_cache_fraction": 0.8} if DEV == "cpu" else {}),
    )  # fmt: skip
    engine = LLMEngine(cfg)
    moe = engine.plan.moe
    log(f"loaded in {time.perf_counter() - t0:.0f} s; {moe.slots}/{moe.experts} experts resident a layer")
    vocab = engine.model_config.vocab_size
    shared = engine.executor.runner.moe.shared if engine.executor.runner is not None else None

    def run(n: int, seed: int) -> float:  # seconds to the prompt's one token
        return run_batch(engine, [[(i * 31 + seed * 7919) % vocab for i in range(n)]], 1)["wall"]

    staging.PRESTAGE = False
    run(32, 0)  # compiles
    run(PROMPT, 1)
    rows: dict[str, list[float]] = {}
    seed = 2
    for name in ROUNDS:
        staging.PRESTAGE = name == "on"
        if shared is not None:
            shared.prestaged.clear()  # the round before's, if any
        for _ in range(5):
            host_ms, copies_ms = idle_for(engine, IDLE_S)
            used = engine.stats().moe_prestaged_layers
            ttft = run(PROMPT, seed)
            seed += 1
            layers = engine.stats().moe_prestaged_layers - used
            staged = sum(p.nbytes for p in shared.prestaged.values()) if shared is not None else 0
            rows.setdefault(name, []).append(1e3 * ttft)
            log(f"pre-staging {name:3s}: TTFT {1e3 * ttft:7.1f} ms, {layers:2d} pre-staged layers computed; "
                f"engine.idle() {host_ms:6.1f} ms host, copies landed {copies_ms:6.1f} ms later; "
                f"{staged / 2**30:.2f} GiB still staged after")  # fmt: skip
    log_medians(log, rows, "pre-staging", "ms TTFT")
    engine.shutdown()


if __name__ == "__main__":
    main()
