"""Batch-1 decode with each combination of the kernel switches, on one loaded model (not a test):

    python tests/gpu/decode_variants.py CONFIG [OUT.log]

Switches (module constants, on by default since timed here): ``triton_moe_gemv.SHARED_AS_PAIR`` (the
shared expert inside the routed MoE GEMV) and ``ft.layers.pdl.ENABLED`` / ``EARLY`` (programmatic
dependent launch: off, wait only, wait and trigger the next launch early). For each combination
the decode graphs are captured again (the switches are read when kernels are traced), then a
1,024-token prompt decodes 256 tokens; the line gives tokens per second over the decode (TTFT
excluded) and the greedy tokens' agreement with the first variant.
Loading a model once instead of once per variant saves most of a device run."""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.layers import pdl  # noqa: E402
from ft.moe.kernels import triton_moe_gemv  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.profiling import logger  # noqa: E402


def main() -> None:
    log = logger(sys.argv[2] if len(sys.argv) > 2 else None)
    engine = LLMEngine(EngineConfig(
        config_file=sys.argv[1], load_format="dummy", device="cuda", num_tokens=20000, max_model_len=2048,
        max_running_requests=8, progress=False,
    ))  # fmt: skip
    runner = engine.executor.runner
    vocab = engine.model_config.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(1024)]
    first = None
    for shared, mode in itertools.product((False, True), ("off", "wait", "early")):
        triton_moe_gemv.SHARED_AS_PAIR, pdl.ENABLED, pdl.EARLY = shared, mode != "off", mode == "early"
        runner.graphs = None
        torch.cuda.empty_cache()
        runner.graphs = runner._decode_graphs(min(8, runner.cfg.cuda_graph_max_bs))
        tokens, rates = None, []
        for _ in range(2):  # the first also compiles what the switches changed
            engine.add_request(prompt, SamplingParams(max_tokens=257, temperature=0.0, ignore_eos=True))
            engine.step()  # the prompt
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                outs = engine.step()
            torch.cuda.synchronize()
            rates.append(256 / (time.perf_counter() - t0))
            tokens = outs[0].token_ids
        first = first or tokens
        same = sum(a == b for a, b in zip(tokens, first)) / len(first)
        log(f"SHARED_AS_PAIR={shared!s:5} PDL={mode:5}: {rates[-1]:7.1f} tok/s batch-1 decode "
            f"(first run {rates[0]:.1f}), greedy tokens as the first variant's: {same:.0%}")  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    main()
