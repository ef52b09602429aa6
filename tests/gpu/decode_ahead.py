"""Decode tok/s with decode ahead off and on, one load (not a test):

    python tests/gpu/decode_ahead.py CONFIG [OUT.log] [KEY=VALUE ...]     # DEV=cpu: a CPU dry run

Loads CONFIG with dummy weights and the engine options KEY=VALUE (values read as Python
literals, else strings: ``moe_backend=offload memory_ratio=0.94 quantize_experts=nvfp4``), warms
up, then times rounds (ROUNDS, default off,on,off,on) of a BATCH (default 1) x 1,024-token prompt
(PROMPT) batch decoding STEPS (default 64) tokens, decode ahead (``LLMEngine.step``) switched per round
on the loaded engine. A round's figure is ``ft bench offline``'s: generated tokens over the wall
time after the first token. ``ft bench offline --no-decode-ahead`` measures one setting a load;
this measures both on one."""

from __future__ import annotations

import ast
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.bench.offline import run_batch  # noqa: E402
from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from tests.gpu.profiling import log_medians, logger  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
ROUNDS = os.environ.get("ROUNDS", "off,on,off,on").split(",")
BATCH = int(os.environ.get("BATCH", "1"))
STEPS = int(os.environ.get("STEPS", "64"))
PROMPT = int(os.environ.get("PROMPT", "1024"))


def literal(value: str):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def main() -> None:
    src = sys.argv[1]
    rest = sys.argv[2:]
    log = logger(rest.pop(0) if rest and "=" not in rest[0] else None)
    options = {k: literal(v) for k, v in (a.split("=", 1) for a in rest)}
    t0 = time.perf_counter()
    cfg = EngineConfig(config_file=src, load_format="dummy", device=DEV, max_running_requests=max(8, BATCH),
                       num_tokens=40000, progress=False, **options)  # fmt: skip
    engine = LLMEngine(cfg)
    log(f"loaded in {time.perf_counter() - t0:.0f} s: {src} {options}; a batch of {BATCH} "
        f"runs unattended (decode ahead applies): {engine.executor.runs_unattended(BATCH)}")  # fmt: skip
    vocab = engine.model_config.vocab_size

    def rate(seed: int) -> float:
        prompts = [
            [(i * 31 + (seed * BATCH + b) * 7919) % vocab for i in range(PROMPT)] for b in range(BATCH)
        ]
        res = run_batch(engine, prompts, STEPS + 1)
        return BATCH * STEPS / (res["wall"] - res["first"])

    rate(0)  # compiles, warms the graphs and the expert cache
    rows: dict[str, list[float]] = {}
    for seed, name in enumerate(ROUNDS, start=1):
        engine.decodes_ahead = name == "on"
        tok_s = rate(seed)
        rows.setdefault(name, []).append(tok_s)
        log(f"decode ahead {name:3s}: {tok_s:8.1f} tok/s ({BATCH} x {STEPS} tokens)")
    log_medians(log, rows, "decode ahead", f"tok/s at batch {BATCH}")
    engine.shutdown()


if __name__ == "__main__":
    main()
