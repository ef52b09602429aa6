"""The ``ft`` command: generate | info | serve | bench."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--config", dest="config_file", help="a config.json (with --load-format dummy)")
    p.add_argument("--num-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--memory-ratio", type=float, default=0.90)
    p.add_argument(
        "--max-running-requests", type=int, default=None,
        help="requests decoded at once, each with a GDN state slot (default 64; when the experts "
        "stream, as many as fit 1/32 of the GPU in state rows, at most 64)",
    )  # fmt: skip
    p.add_argument(
        "--chunked-prefill-size", dest="max_num_batched_tokens", type=int, default=None,
        help="tokens a prefill chunk takes (default 8192; with offloaded experts up to 32768, as the "
        "activation reserve allows: every chunk streams every host expert once)",
    )  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--disable-prefix-cache",
        dest="enable_prefix_cache",
        action="store_false",
        help="no prefix cache (on hybrid models it also stops ending a chunk at each prompt's last block)",
    )
    p.add_argument(
        "--prefix-snapshot-slots", type=int, default=None,
        help="recurrent-state snapshots the prefix cache of a hybrid (GDN) model keeps (default: "
        "--max-running-requests); each holds one request's GDN state, device memory an offloaded "
        "model's expert cache could use instead",
    )  # fmt: skip
    p.add_argument(
        "--decode-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="issue each decode step before the tokens of the one running are read (on)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for requests that leave them out: auto (the checkpoint's "
        "generation_config.json), none (ft's own), or a directory holding one",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist-timeout", dest="dist_timeout_s", type=float, default=1800.0)
    p.add_argument(
        "--quantize-experts", choices=["nvfp4"], default=None, help="quantise bf16 routed experts at load"
    )
    add_moe_args(p)


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MoE placement (ft.moe.backends)")
    g.add_argument(
        "--moe-backend",
        default="auto",
        choices=["auto", "gpu", "offload", "hybrid", "cpu"],
        help="where routed experts live (default: gpu when they fit, else offload)",
    )
    g.add_argument(
        "--max-gpu-memory",
        default=None,
        help="cap on the memory used on each GPU, e.g. 48GiB (the plan and torch's allocator keep to it)",
    )
    g.add_argument(
        "--max-host-memory",
        default=None,
        help="host memory the expert store may plan for (default: MemTotal)",
    )
    g.add_argument(
        "--expert-cache-fraction",
        type=float,
        default=None,
        help="GPU cache slots per layer as a fraction of its experts (default: what memory allows)",
    )
    g.add_argument("--expert-cache-policy", default="lru", choices=["lru", "lfu"], help="eviction policy")
    g.add_argument(
        "--static-experts",
        type=int,
        default=None,
        help="experts per layer kept on the GPU only, no host copy (default: what the host needs)",
    )
    g.add_argument(
        "--disable-moe-prefetch",
        dest="moe_prefetch",
        action="store_false",
        help="do not copy the next layer's predicted experts a layer early",
    )
    g.add_argument(
        "--moe-prefill-hit-d2d",
        action="store_true",
        help="prefill: copy resident experts device-to-device into staging instead of using them in place",
    )
    g.add_argument(
        "--moe-stream-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="long batches: stage each layer's first groups of experts before its router runs (on)",
    )
    g.add_argument("--moe-staging-experts", type=int, default=None, help="experts per prefill staging buffer")
    g.add_argument(
        "--dummy-routing-skew",
        type=float,
        default=0.0,
        help="with --load-format dummy: Zipf-like expert popularity of exponent S (0: uniform)",
    )
    p.add_argument(
        "--ple-backend",
        choices=["device", "pinned"],
        default="device",
        help="keep a PLE n-gram table on the GPU, or in pinned host memory",
    )


ENGINE_KEYS = (
    "model",
    "tp_size",
    "device",
    "dtype",
    "load_format",
    "config_file",
    "num_tokens",
    "memory_ratio",
    "max_running_requests",
    "max_num_batched_tokens",
    "max_model_len",
    "block_size",
    "enable_prefix_cache",
    "prefix_snapshot_slots",
    "decode_ahead",
    "generation_config",
    "seed",
    "dist_timeout_s",
    "quantize_experts",
    "ple_backend",
    "moe_backend",
    "max_gpu_memory",
    "max_host_memory",
    "expert_cache_fraction",
    "expert_cache_policy",
    "static_experts",
    "moe_prefetch",
    "moe_prefill_hit_d2d",
    "moe_stream_ahead",
    "moe_staging_experts",
    "dummy_routing_skew",
)


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}


def engine_config(command: str, options: dict):
    """The ``EngineConfig`` of ``options``, checked against the model's config.json (reading no
    weight), or an exit with the message that names the bad option: no traceback, nothing started."""
    from ft.config import EngineConfig
    from ft.engine.build import model_config_of

    try:
        cfg = EngineConfig(**options)
        model_config_of(cfg)
    except (ValueError, OSError) as e:
        raise SystemExit(f"ft {command}: {e}") from None
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    from ft import LLM, SamplingParams

    options = engine_options(args)
    prompt = generate_prompt(args, engine_config("generate", options))
    with LLM(**options) as llm:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            ignore_eos=args.ignore_eos,
        )
        out = llm.generate([prompt], params)[0]
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0


def generate_prompt(args: argparse.Namespace, cfg) -> str | list[int]:
    """``--prompt`` as the engine takes it, or an exit naming it, before the model loads."""
    import os

    from ft.config import TOKENIZER_FILES

    if args.token_ids:
        try:
            return [int(t) for t in args.prompt.split(",")]
        except ValueError:
            raise SystemExit(
                f"ft generate: --prompt {args.prompt!r}: expected comma-separated token ids, e.g. 1,2,3"
            ) from None
    where = cfg.tokenizer or cfg.model
    if where is None or not any(os.path.exists(os.path.join(where, f)) for f in TOKENIZER_FILES):
        raise SystemExit(
            f"ft generate: --prompt {args.prompt!r} is text, and {where or cfg.config_file!r} has no "
            "tokenizer files: give token ids with --token-ids"
        )
    return args.prompt


def cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ft.engine.build import tp_refusal
    from ft.models.config_json import load_model_config
    from ft.models.info import format_info

    try:
        sizes = [int(s) for s in str(args.tp_size).split(",")]
    except ValueError:
        raise SystemExit(f"ft info: --tp-size {args.tp_size!r}: expected sizes like 1,2,4,8") from None
    try:
        mc = load_model_config(args.model or args.config_file)
    except (ValueError, OSError) as e:
        raise SystemExit(f"ft info: {e}") from None
    if args.quantize_experts:
        mc = replace(mc, expert_format=args.quantize_experts)
    for tp in sizes:
        try:
            why = "must be at least 1" if tp < 1 else tp_refusal(mc, tp)
        except ValueError as e:  # the model itself, whatever the split
            raise SystemExit(f"ft info: {e}") from None
        if why:
            raise SystemExit(f"ft info: --tp-size {tp}: {why}")
    print(format_info(mc, sizes))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="print the continuation of a prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="config, parameter counts and per-rank bytes, reading no weights")
    i.add_argument("--model", help="checkpoint directory (or a config.json)")
    i.add_argument("--config", dest="config_file")
    i.add_argument("--tp-size", default="1", help="one size or a list, e.g. 1,2,4,8")
    i.add_argument("--quantize-experts", choices=["nvfp4"], default=None, help="size experts as if quantised")
    i.set_defaults(func=cmd_info)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands that live beside their subsystems (server, benchmarks)."""
    found = []
    for module in ("ft.server.cli", "ft.bench.cli"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError as e:
            if e.name and e.name.startswith("ft."):
                continue
            raise
        found.append(mod.register)
    return found


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info" and not (args.model or args.config_file):
        print("ft info: give --model DIR or --config FILE", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
