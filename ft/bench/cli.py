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
    from ft.bench.offline import add_offline_parser

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
