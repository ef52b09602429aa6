"""``ft bench``: ``offline`` measures the engine in this process (``ft.bench.offline``); ``serve``
loads a running OpenAI-compatible server (``ft.bench.serve``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    add_offline_parser(kinds)
    s = kinds.add_parser("serve", help="latency and throughput of a running server (streamed completions)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    s.add_argument("--model", help="model name to send (default: the first the server lists)")
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    s.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    s.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    s.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="send token-id lists, or the text of random tokens (needs --tokenizer)",
    )
    s.add_argument("--tokenizer", help="tokenizer directory, for --prompt-format text")
    s.add_argument("--vocab-size", type=int, help="draw prompt ids below this (default: from /v1/models)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--api-key", default=os.environ.get("FT_API_KEY"))
    s.add_argument("--output-json", help="write the results here")
    s.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ft.bench.serve import BenchConfig, format_report, run

    if args.prompt_format == "text" and not args.tokenizer:
        print("ft bench serve: --prompt-format text needs --tokenizer", file=sys.stderr)
        return 2
    if min(args.num_prompts, args.concurrency, args.input_len, args.output_len) < 1:
        print("ft bench serve: counts and lengths must be at least 1", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        base_url=args.base_url,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        model=args.model,
        prompt_format=args.prompt_format,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        temperature=args.temperature,
        seed=args.seed,
        api_key=args.api_key,
    )
    result = asyncio.run(run(cfg))
    print(format_report(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed"] == 0 else 1


def add_offline_parser(bench_sub) -> None:
    from ft.cli import add_engine_args

    p = bench_sub.add_parser("offline", help="throughput, latency and roofline ratio on this machine")
    add_engine_args(p)
    p.add_argument("--batch-sizes", default="1,8,16,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-lens", default="8192,32768")
    p.add_argument(
        "--prefill-runs",
        type=int,
        default=1,
        help="prefill each --prefill-lens length this many times after its warm-up (fresh prompts): every "
        "run printed, the middle one reported",
    )
    p.add_argument("--compare-hf", action="store_true", help="add a row for transformers' generate")
    p.add_argument(
        "--census", action="store_true", help="count and time the kernels of a decode step and a prefill"
    )
    p.add_argument("--census-batch", type=int, default=1, help="sequences in the decode step --census counts")
    p.add_argument(
        "--expert-cache-policies",
        default=None,
        help="offload: measure each of these policies (e.g. lru,lfu) on the one loaded model",
    )
    p.add_argument(
        "--dummy-routing-skews",
        default=None,
        help="with --load-format dummy: measure each routing skew (e.g. 0,1) on the one loaded model",
    )
    p.add_argument(
        "--ttft-idle-s",
        type=float,
        default=0.0,
        help="leave the engine idle this many seconds before each TTFT run (a request that finds it idle)",
    )
    p.add_argument("--output-json", default=None, help="the report; a list of them for several variants")
    p.set_defaults(func=cmd_offline)


def _counts(flag: str, text: str) -> list[int]:
    """The comma-separated positive integers of ``flag`` (empty: none)."""
    try:
        counts = [int(s) for s in text.split(",") if s]
    except ValueError:
        counts = [0]
    if any(n < 1 for n in counts):
        raise SystemExit(f"ft bench: {flag} {text!r}: expected positive integers, e.g. 1,8,16")
    return counts


def cmd_offline(args) -> int:
    from ft.bench.census import CENSUS_TOKENS
    from ft.bench.offline import bench
    from ft.bench.report import as_dict, format_report
    from ft.cli import engine_config, engine_options
    from ft.moe.backends.sizing import DEFAULT_RUNNING

    sizes = _counts("--batch-sizes", args.batch_sizes)
    prefill = _counts("--prefill-lens", args.prefill_lens)
    try:
        skews = [float(s) for s in (args.dummy_routing_skews or "").split(",") if s]
    except ValueError:
        raise SystemExit(
            f"ft bench: --dummy-routing-skews {args.dummy_routing_skews!r}: expected numbers, e.g. 0,1"
        ) from None
    skews = skews or [args.dummy_routing_skew]
    policies = [s for s in (args.expert_cache_policies or "").split(",") if s] or [args.expert_cache_policy]
    variants = [(skew, policy) for skew in skews for policy in policies]
    for flag in ("--input-len", "--output-len", "--census-batch", "--prefill-runs"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            raise SystemExit(f"ft bench: {flag} must be at least 1, got {value}")
    # not given: 64 running requests, as every row before 2026-12-05 ran (not the engine's default,
    # fewer when the experts stream), so rows stay comparable
    given = args.max_running_requests or DEFAULT_RUNNING
    running = max(sizes + [given, args.census_batch if args.census else 1])
    options = engine_options(args) | {"max_running_requests": running}
    # the engine loads with the first variant and switches in place to the others
    options |= {"dummy_routing_skew": skews[0], "expert_cache_policy": policies[0]}
    census_len = args.input_len + CENSUS_TOKENS + args.census_batch if args.census else 0
    longest = max([n + 1 for n in prefill] + [args.input_len + args.output_len + 1, census_len])
    hint = ""
    if not options.get("max_model_len"):
        options["max_model_len"] = longest
        hint = (
            f"; ft bench sets max_model_len to its longest request, {longest} tokens (--prefill-lens, "
            "--input-len + --output-len): shorten those"
        )
    try:
        cfg = engine_config("bench", options)
    except SystemExit as e:
        if hint and "max_model_len" in str(e):
            raise SystemExit(f"{e}{hint}") from None
        raise
    for skew, policy in variants[1:]:  # switched to after the load: checked before it
        engine_config("bench", options | {"dummy_routing_skew": skew, "expert_cache_policy": policy})
    reports = bench(
        cfg,
        sizes,
        args.input_len,
        args.output_len,
        prefill,
        compare_hf=args.compare_hf,
        with_census=args.census,
        census_batch=args.census_batch,
        variants=variants,
        ttft_idle_s=args.ttft_idle_s,
        prefill_runs=args.prefill_runs,
    )
    print("\n\n".join(format_report(r) for r in reports))
    if args.output_json:
        with open(args.output_json, "w") as f:
            dicts = [as_dict(r) for r in reports]
            json.dump(dicts[0] if len(dicts) == 1 else dicts, f, indent=2)
    return 0
