"""Batch-1 decode with kernel switches turned on one at a time, on one loaded model (not a test):

    python tests/gpu/decode_variants.py CONFIG [OUT.log] [--nvfp4] [--max-gpu-memory=SIZE] [--layers=N]
                                        [--prompt=TOKENS[,...]] [module:SWITCH[=0] ...]

A switch is a module-level boolean (or an integer, given ``=N``) read when a kernel is launched or
traced (by default every switch of ``ft.switches`` still off, but the tensor-parallel one, each
turned on; ``=0`` turns one off instead). The first row runs the defaults, then each switch alone,
then all of them together (when they name more than one switch). For each row the decode graphs are
captured again, then a 1,024-token prompt decodes 256 tokens: the same prompt in every row, with the
prefix cache off so that each prompt step computes it whole. The line gives tokens per second over
the decode, the prompt step's time (eager, host-bound at this size), and the greedy tokens'
agreement with the first row (a switch that changes rounding changes tokens on a random-weight
model: judge it by its accuracy test, not by this).
``--nvfp4`` quantises the experts while loading (switches of the NVFP4 kernels);
``--max-gpu-memory=SIZE`` caps the GPU budget and offloads the experts that do not fit (e.g.
``ft.moe.backends.host_reads:ENABLED``, the offload backend's decode path).
``--prompt=TOKENS[,TOKENS...]`` decodes after a prompt of each length instead of 1,024, a line each
(long-context decode beside a short one, e.g. ``ft.attention.triton_paged:MAX_SPLITS=128``); the
prompt time is then its chunks'.
Loading a model once instead of once per variant saves most of a device run."""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402
from ft.switches import current  # noqa: E402
from tests.gpu.profiling import cut_config, logger  # noqa: E402

# switches of prefill kernels only (the rows time decode; their prompt step would run them)
PREFILL_ONLY = (
    "ft.attention.gluon_extend_ws:WS",
    "ft.moe.kernels.triton_w4a16:GLUON",
)


def switches_off() -> list[str]:
    """The kernel switches still off (``ft.switches``), but the tensor-parallel one (one GPU here), the
    offload backend's (a resident model here) and the prefill kernels' (``PREFILL_ONLY``)."""
    return [  # integer switches (off at 0) need a value: name them with =N
        key
        for key, on in current().items()
        if on is False
        and not key.startswith(("ft.distributed", "ft.moe.backends"))
        and key not in PREFILL_ONLY
    ]


def resolve(spec: str) -> tuple[object, str, bool | int]:
    """``module:ATTR`` (turned on) or ``module:ATTR=0`` (turned off) -> (module, ATTR, value); an
    integer switch takes ``=N`` (e.g. ``ft.moe.backends.host_prefetch:ROWS=2``, whose spare rows
    are sized at start: run with FT_MOE_HOST_PREFETCH set to the largest N)."""
    target, _, value = spec.partition("=")
    module, name = target.split(":")
    mod = importlib.import_module(module)
    current_value = getattr(mod, name, None)
    if isinstance(current_value, bool):
        return mod, name, value != "0"
    if isinstance(current_value, int) and value:
        return mod, name, int(value)
    raise SystemExit(f"{spec}: not a boolean switch of {module}, nor an integer one given =N")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    config, out = args[0], (args[1] if len(args) > 1 and ":" not in args[1] else None)
    specs = [a for a in args[1:] if ":" in a] or switches_off()
    switches = [resolve(s) for s in specs]
    log = logger(out)
    cap = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--max-gpu-memory=")), None)
    cut = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--layers=")), None)
    if cut:  # the config's first LAYERS layers (e.g. a 16-layer Qwen3-Next whose experts offload)
        config = cut_config(config, cut)[0]
    offload = dict(max_gpu_memory=cap, moe_backend="offload") if cap else {}
    spec = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--prompt=")), "1024")
    lengths = [int(n) for n in spec.split(",")]
    engine = LLMEngine(EngineConfig(
        config_file=config, load_format="dummy", device="cuda", num_tokens=max(20000, max(lengths) + 1024),
        max_model_len=max(2048, max(lengths) + 512),
        max_running_requests=8, progress=False, enable_prefix_cache=False,
        quantize_experts="nvfp4" if "--nvfp4" in sys.argv else None, **offload,
    ))  # fmt: skip
    runner = engine.executor.runner
    vocab = engine.model_config.vocab_size
    defaults = [getattr(mod, name) for mod, name, _ in switches]
    rows = [("defaults", [])] + [(s, [i]) for i, s in enumerate(specs)]
    if len({(id(mod), name) for mod, name, _ in switches}) > 1:  # one switch's values: nothing to sum
        rows.append(("all of them", range(len(specs))))
    first: dict[int, list[int]] = {}
    for label, on in rows:
        set_row(switches, defaults, on)
        runner.graphs = None
        torch.cuda.empty_cache()
        runner.graphs = runner._decode_graphs(
            min(8, runner.cfg.cuda_graph_max_bs, runner.moe.max_graph_batch())
        )
        for length in lengths:
            runner.moe.discard_uses()
            prompt = [(i * 7919 + 13) % vocab for i in range(length)]
            tokens, rates = None, []
            for _ in range(2):  # the first also compiles what the switches changed
                engine.add_request(prompt, SamplingParams(max_tokens=257, temperature=0.0, ignore_eos=True))
                torch.cuda.synchronize()
                t_prompt = time.perf_counter()
                while not any(o.token_ids for o in engine.step()):  # the prompt's chunks
                    pass
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                prompt_ms = 1e3 * (t0 - t_prompt)
                before = engine.stats()
                while engine.has_unfinished_requests():
                    outs = engine.step()
                torch.cuda.synchronize()
                rates.append(256 / (time.perf_counter() - t0))  # the first token came with the prompt
                tokens = outs[0].token_ids
            moe = moe_line(before, engine.stats()) if cap else ""
            first.setdefault(length, tokens)
            same = sum(a == b for a, b in zip(tokens, first[length])) / len(first[length])
            log(f"{label:50}: {rates[-1]:7.1f} tok/s batch-1 decode (first run {rates[0]:.1f}), "
                f"{length}-token prompt {prompt_ms:.1f} ms, greedy tokens as the first row's: {same:.0%}"
                f"{moe}")  # fmt: skip
    engine.shutdown()


def set_row(switches: list[tuple[object, str, bool | int]], defaults: list, on) -> None:
    """Every switch back to its default, then the row's (``on``: indices into ``switches``) set in
    order. Two specs of one switch (``host_prefetch:ROWS=0 host_prefetch:ROWS=2``) are two rows
    of it: setting each spec to its value or its default in one pass let the last spec's default
    undo the row's own value (every such row but the last ran the default; fixed 2026-12-01)."""
    for (mod, name, _), default in zip(switches, defaults):  # one default a switch: read at start
        setattr(mod, name, default)
    for i in on:
        mod, name, value = switches[i]
        setattr(mod, name, value)


def moe_line(a, b) -> str:
    """The offloaded decode's expert hit rate and PCIe bytes per token between two stats: all of
    them, then the copies into the cache (promotions, prefetches) and the kernels' host reads."""
    keys = ("moe_hits", "moe_misses", "moe_bytes_h2d", "moe_bytes_host_read", "moe_evictions")
    d = {k: getattr(b, k) - getattr(a, k) for k in keys}
    mb = lambda n: n / 256 / 1e6  # noqa: E731
    return (
        f"; decode hit rate {d['moe_hits'] / max(1, d['moe_hits'] + d['moe_misses']):.1%}, "
        f"{mb(d['moe_bytes_h2d'] + d['moe_bytes_host_read']):.1f} MB over PCIe a token "
        f"(copied {mb(d['moe_bytes_h2d']):.1f}, host reads {mb(d['moe_bytes_host_read']):.1f}; "
        f"{d['moe_evictions'] / 256:.2f} evictions a token)"
    )


if __name__ == "__main__":
    main()
