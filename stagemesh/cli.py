"""The `stagemesh` command: one subcommand per service, flags taken from each config dataclass."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


def _layers(spec: str) -> tuple[int, int | None]:
    try:
        a, b = spec.split(":")
        return int(a), (int(b) if b else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {spec!r}: use A:B (layers A..B-1), e.g. 0:4") from None


def _run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def cmd_stage(a: argparse.Namespace) -> None:
    from stage_server.server import StageConfig, serve

    start, end = a.layers
    _run(serve(StageConfig(
        model=a.model, layer_start=start, layer_end=end, host=a.host, port=a.port, device=a.device,
        dtype=a.dtype, kv_cache_gb=a.kv_cache_gb, session_timeout_s=a.session_timeout,
        batch_window_ms=a.batch_window_ms, max_batch_tokens=a.max_batch_tokens, threads=a.threads,
    )))


def cmd_router(a: argparse.Namespace) -> None:
    from router.server import RouterConfig, serve

    _run(serve(RouterConfig(model=a.model, chains=a.chain, host=a.host, port=a.port,
                            prefill_chunk=a.prefill_chunk)))


def cmd_up(a: argparse.Namespace) -> None:
    from stagemesh.launcher import run_up

    run_up(model=a.model, stages=a.stages, replicas=a.replicas, port=a.port, dtype=a.dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagemesh", description="Distributed LLM inference over gRPC.")
    p.add_argument("--log-level", default=os.environ.get("STAGEMESH_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("stage", help="serve a slice of a model's layers")
    s.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    s.add_argument("--layers", type=_layers, required=True, help="A:B serves decoder layers A..B-1")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port")
    s.add_argument("--device", default="auto", help="auto, cpu or cuda")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache pool size (default: a quarter of available memory)")
    s.add_argument("--session-timeout", type=float, default=300.0,
                   help="seconds after which an idle session is closed")
    s.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="wait this long for more steps to batch together")
    s.add_argument("--max-batch-tokens", type=int, default=2048)
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    s.set_defaults(func=cmd_stage)

    r = sub.add_parser("router", help="the front door: streams tokens through pipeline chains")
    r.add_argument("--model", required=True, help="local checkpoint directory (tokenizer and config)")
    r.add_argument("--chain", action="append", required=True,
                   help="HOST:PORT,HOST:PORT,... in pipeline order; repeat for more chains")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=50051)
    r.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per pipelined chunk (0: off)")
    r.set_defaults(func=cmd_router)

    u = sub.add_parser("up", help="start stage servers and a router on this machine")
    u.add_argument("--model", default=None, help="checkpoint directory (default: make a tiny one)")
    u.add_argument("--stages", type=int, default=2, help="pipeline stages per chain")
    u.add_argument("--replicas", type=int, default=1, help="chains")
    u.add_argument("--port", type=int, default=50051, help="the router's port")
    u.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    u.set_defaults(func=cmd_up)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from stagemesh.log import setup_logging

    setup_logging(args.log_level)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"stagemesh {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
