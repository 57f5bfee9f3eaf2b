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
    from stage_server.main import serve
    from stage_server.server import StageConfig

    start, end = a.layers or (None, None)
    _run(serve(StageConfig(
        model=a.model, layer_start=start, layer_end=end, host=a.host, port=a.port, device=a.device,
        dtype=a.dtype, kv_cache_gb=a.kv_cache_gb, session_timeout_s=a.session_timeout,
        batch_window_ms=a.batch_window_ms, max_batch_tokens=a.max_batch_tokens, threads=a.threads,
        registry=a.registry, model_name=a.model_name, memory_gb=a.memory_gb, speed=a.speed, quantize=a.quantize,
        preload=a.preload,
    )))


def cmd_router(a: argparse.Namespace) -> None:
    from router.priority_queue import AdmissionConfig
    from router.server import RouterConfig, serve

    admission = AdmissionConfig(slots_per_chain=a.slots_per_chain, aging_s=a.aging)
    _run(serve(RouterConfig(model=a.model, chains=a.chain or [], host=a.host, port=a.port,
                            prefill_chunk=a.prefill_chunk, wire_dtype=a.wire_dtype, registry=a.registry,
                            model_name=a.model_name,
                            admission=admission, metrics_port=a.metrics_port)))


def cmd_registry(a: argparse.Namespace) -> None:
    from registry.service import serve_registry

    _run(serve_registry(a.host, a.port))


def cmd_scheduler(a: argparse.Namespace) -> None:
    from scheduler.placement import PlacementConfig
    from scheduler.scheduler import SchedulerConfig

    config = SchedulerConfig(model=a.model, model_name=a.model_name, dtype=a.dtype, quantize=a.quantize,
                             lock_ttl_s=a.lock_ttl,
                             placement=PlacementConfig(kv_headroom_fraction=a.kv_headroom))
    _run(_scheduler_hosting_registry(config, a.registry, a.host, a.registry_port))


async def _scheduler_hosting_registry(config, registry_url: str, host: str, registry_port: int) -> None:
    """registry_url "local" hosts the embedded registry in this process, on registry_port."""
    from registry.service import start_registry_server
    from scheduler.server import serve_scheduler

    hosted = None
    if registry_url == "local":
        hosted = await start_registry_server(host, registry_port)
        registry_url = f"local://{hosted.address}"
        print(f"registry ready on {hosted.address}", flush=True)
    try:
        await serve_scheduler(config, registry_url)
    finally:
        if hosted:
            await hosted.stop()


def cmd_plan(a: argparse.Namespace) -> None:
    from pathlib import Path

    from scheduler.server import print_plan

    print(asyncio.run(print_plan(a.registry, a.model_name or Path(a.model).name)))


def cmd_up(a: argparse.Namespace) -> None:
    from stagemesh.launcher import run_up

    run_up(model=a.model, stages=a.stages, replicas=a.replicas, port=a.port, dtype=a.dtype, registry=a.registry,
           quantize=a.quantize)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagemesh", description="Distributed LLM inference over gRPC.")
    p.add_argument("--log-level", default=os.environ.get("STAGEMESH_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("stage", help="serve a slice of a model's layers")
    s.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    s.add_argument("--layers", type=_layers, default=None,
                   help="A:B serves decoder layers A..B-1 (default: the scheduler assigns a range)")
    s.add_argument("--registry", default=None, help="local://HOST:PORT or consul://HOST:PORT to announce this stage")
    s.add_argument("--model-name", default="", help="the model's name in the registry (default: the directory name)")
    s.add_argument("--memory-gb", type=float, default=None,
                   help="memory budget announced to the scheduler (default: memory available at start)")
    s.add_argument("--speed", type=float, default=1.0, help="relative speed announced to the scheduler")
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
    s.add_argument("--preload", action="store_true",
                   help="read every weight page at start (cold start is then reported apart from serving)")
    s.add_argument("--quantize", default="none", choices=["none", "int8", "int8-weight-only"],
                   help="int8: Linear weights in int8 (int8 kernels on CPU float32, weight-only elsewhere); "
                        "int8-weight-only: the portable path on any device (see the README for the accuracy cost)")
    s.set_defaults(func=cmd_stage)

    r = sub.add_parser("router", help="the front door: streams tokens through pipeline chains")
    r.add_argument("--model", required=True, help="local checkpoint directory (tokenizer and config)")
    r.add_argument("--chain", action="append", default=None,
                   help="HOST:PORT,HOST:PORT,... in pipeline order; repeat for more chains")
    r.add_argument("--registry", default=None, help="follow the chains the scheduler publishes there")
    r.add_argument("--model-name", default="", help="the model's name in the registry (default: the directory name)")
    r.add_argument("--slots-per-chain", type=int, default=32, help="streams that run at once per chain")
    r.add_argument("--aging", type=float, default=10.0, help="seconds of waiting worth one priority class")
    r.add_argument("--wire-dtype", default="", choices=["", "float32", "bfloat16", "float16", "int8"],
                   help="hidden states between stages (default: each stage's own dtype)")
    r.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=50051)
    r.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per pipelined chunk (0: off)")
    r.set_defaults(func=cmd_router)

    g = sub.add_parser("registry", help="the embedded registry on its own (one machine)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=50050)
    g.set_defaults(func=cmd_registry)

    c = sub.add_parser("scheduler", help="place layers on the registered stages and publish chains")
    c.add_argument("--model", required=True, help="local checkpoint directory (config and tensor sizes)")
    c.add_argument("--registry", default="local",
                   help="'local' hosts the embedded registry here; or local://HOST:PORT, consul://HOST:PORT")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--registry-port", type=int, default=50050, help="port of the hosted registry (with 'local')")
    c.add_argument("--model-name", default="")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--quantize", default="none", choices=["none", "int8", "int8-weight-only"],
                   help="the stages' --quantize: sizes int8 Linear weights at one byte (more layers per host)")
    c.add_argument("--lock-ttl", type=float, default=3.0, help="seconds before a standby scheduler takes over")
    c.add_argument("--kv-headroom", type=float, default=0.2, help="share of each host's memory kept for KV cache")
    c.set_defaults(func=cmd_scheduler)

    pl = sub.add_parser("plan", help="print the scheduler's current plan and chains")
    pl.add_argument("--model", required=True)
    pl.add_argument("--registry", default="local://127.0.0.1:50050")
    pl.add_argument("--model-name", default="")
    pl.set_defaults(func=cmd_plan)

    u = sub.add_parser("up", help="start stage servers and a router on this machine")
    u.add_argument("--model", default=None, help="checkpoint directory (default: make a tiny one)")
    u.add_argument("--stages", type=int, default=2, help="pipeline stages per chain")
    u.add_argument("--replicas", type=int, default=1, help="chains")
    u.add_argument("--port", type=int, default=50051, help="the router's port")
    u.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    u.add_argument("--quantize", default="none", choices=["none", "int8", "int8-weight-only"],
                   help="int8 Linear weights in every stage (and the scheduler sizes them so)")
    u.add_argument("--registry", default="local", help="local (embedded, one machine) or consul://HOST:PORT")
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
