"""``ft serve``: start the engine process, then the HTTP server; stop both on SIGINT / SIGTERM.

The listening socket is bound first (a port in use fails before a long model load), the URL and
the memory plan are printed once the engine is ready, and the socket is handed to uvicorn.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from ft.cli import add_engine_args, engine_options


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_engine_args(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--api-key",
        default=os.environ.get("FT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on all but /health and /metrics (default: $FT_API_KEY)",
    )
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 while this many requests wait to start (default: no limit)",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=None, help="largest request body (default 32 MiB)"
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3"],
        default=None,
        help="chat answers give a thinking model's reasoning apart, as reasoning_content",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if not (args.model or args.config_file):
        print("ft serve: give --model DIR (or --config FILE --load-format dummy)", file=sys.stderr)
        return 2
    why = _bad_server_option(args)
    if why:
        print(f"ft serve: {why}", file=sys.stderr)
        return 2
    from ft.config import EngineConfig
    from ft.engine.build import model_config_of
    from ft.generation_config import sampling_defaults
    from ft.server.engine_client import EngineClient, EngineDeadError

    try:
        cfg = EngineConfig(
            **engine_options(args),
            tokenizer=args.tokenizer,
        )
        defaults = sampling_defaults(cfg.generation_config, cfg.model)
        model_config_of(cfg)  # options the model cannot take, before the engine process starts
    except (ValueError, OSError) as e:
        print(f"ft serve: {e}", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"ft serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    previous_term = signal.signal(signal.SIGTERM, _interrupt)  # until uvicorn takes over
    client = EngineClient(cfg)
    try:
        client.spawn()  # the engine loads its model while this process sets up HTTP
        return _serve(args, cfg, client, sock, defaults)
    except EngineDeadError as e:
        print(f"ft serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        client.shutdown()
        sock.close()
        print("ft serve: stopped", flush=True)


def _serve(args: argparse.Namespace, cfg, client, sock: socket.socket, defaults: dict) -> int:
    import uvicorn

    from ft.generation_config import describe
    from ft.server.app import DEFAULT_MAX_REQUEST_BYTES, Server, build_app
    from ft.server.metrics import Metrics
    from ft.server.serving import ServerState
    from ft.server.tokenizer import Tokenizer

    name = args.served_model_name or args.model or "ft"
    tokenizer = Tokenizer.load(cfg.tokenizer or cfg.model)
    metrics = Metrics(name, lambda: client.stats)
    client.on_first_token, client.on_token_gap = metrics.ttft.observe, metrics.itl.observe
    state = ServerState(
        client, tokenizer, metrics, name, args.max_waiting_requests, args.reasoning_parser, defaults
    )
    app = build_app(state, args.api_key, args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    config = uvicorn.Config(
        app, log_level=args.log_level, access_log=args.access_log, timeout_graceful_shutdown=5
    )
    server = Server(config)

    def on_fatal(why: str) -> None:
        print(f"ft serve: {why}", file=sys.stderr, flush=True)
        server.should_exit = True

    client.on_fatal = on_fatal
    info = client.wait_ready()
    print(_plan(name, info), flush=True)
    if defaults:
        print(
            f"ft serve: {describe(defaults)} (a request's own values win; --generation-config none for ft's)",
            flush=True,
        )
    if tokenizer is None:
        print("ft serve: no tokenizer files: prompts must be token ids, answers carry no text", flush=True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"ft serve: ready at http://{shown}:{port}  (OpenAI API under /v1; Ctrl-C stops)", flush=True)
    server.run(sockets=[sock])
    return 1 if client.dead is not None else 0


def _bad_server_option(args: argparse.Namespace) -> str | None:
    """What is wrong with the HTTP side's numbers, if anything (the engine's are EngineConfig's).
    A port past 65535 would be taken modulo 65536 by getaddrinfo: 70000 listens on 4464."""
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: expected 0 to 65535 (0 picks a free port)"
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        return "--max-waiting-requests must be at least 1"
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        return "--max-request-bytes must be at least 1"
    return None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(2048)  # connections that arrive while the model loads wait in the backlog
    return sock


def _plan(name: str, info) -> str:
    mib = 1 << 20
    return "\n".join(
        [
            f"ft serve: model {name!r}: tp {info.tp_size}, {info.device}, {info.dtype}; context "
            f"{info.max_model_len} tokens",
            f"  per rank: weights {info.weight_bytes / mib:.1f} MiB, KV cache {info.kv_bytes / mib:.1f} MiB "
            f"= {info.pool_tokens} tokens ({info.num_blocks} blocks of {info.block_size}), GDN state "
            f"{info.state_bytes / mib:.1f} MiB = {info.num_slots} slots",
        ]
    )
