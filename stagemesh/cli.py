"""The `stagemesh` command: one subcommand per service, its flags made from the service's config dataclass
(stagemesh/config_flags.py), so that a knob's name, default, help and bounds are written once, there."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stagemesh import (
    __version__,
    grpc_transport,  # noqa: F401  (first: sets gRPC's transport before grpc is imported)
    launcher,
    tls,
)
from stagemesh.bench import BenchConfig, run_bench
from stagemesh.certs import CertsConfig, run_certs
from stagemesh.config_flags import add_flags, defaults_from, deprecated_spellings, from_args
from stagemesh.launcher import UpConfig
from stagemesh.log import LOG_FORMATS, setup_logging
from stagemesh.processes import PARENT_PID_ENV
from stagemesh.registry.config import RegistryConfig
from stagemesh.registry.service import serve_registry, start_registry_server
from stagemesh.rolling import RollConfig, run_roll
from stagemesh.router.server import RouterConfig
from stagemesh.router.server import serve as serve_router
from stagemesh.scheduler.scheduler import SchedulerConfig
from stagemesh.scheduler.server import PlanConfig, print_plan, serve_scheduler
from stagemesh.stage_server.config import StageConfig
from stagemesh.tracing import setup_tracing


def _run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def run_stage(config: StageConfig) -> None:
    # Imported here, not above: the stage's torch and transformers are ~4 s of a process's start, which the
    # router, scheduler and registry processes (this same command) must not pay. test_layout holds them to it.
    from stagemesh.stage_server.main import serve as serve_stage

    setup_tracing("stagemesh-stage", config.tracing.otlp_endpoint)
    _run(serve_stage(config))


@dataclass
class KernelsConfig:
    """`stagemesh kernels`: builds stagemesh's CPU kernels into this user's cache now, where a C++ compiler exists,
    so that no stage's first start pays for the build: run it after `pip install`, or in an image build. A stage
    still builds them on first use where this was not run."""

    quiet: bool = False
    """Print nothing; the exit status says whether they were built (0) or could not be (1)."""


def run_kernels(config: KernelsConfig) -> None:
    # Imported here, not above: torch, for the stage's kernels only (see run_stage).
    from stagemesh.stage_server.cpu import cpu_kernels

    built = cpu_kernels.load()
    if not config.quiet:
        print(f"CPU kernels: {'ready' if built else 'not built'} ({cpu_kernels.status()})")
    sys.exit(0 if built else 1)


def run_router(config: RouterConfig) -> None:
    setup_tracing("stagemesh-router", config.tracing.otlp_endpoint)
    _run(serve_router(config))


def run_registry(config: RegistryConfig) -> None:
    setup_tracing("stagemesh-registry", config.tracing.otlp_endpoint)
    _run(serve_registry(config.host, config.port, tls.load(config.tls, "scheduler")))


def run_scheduler(config: SchedulerConfig) -> None:
    setup_tracing("stagemesh-scheduler", config.tracing.otlp_endpoint)
    _run(_scheduler_hosting_registry(config))


async def _scheduler_hosting_registry(config: SchedulerConfig) -> None:
    """--registry local hosts the embedded registry in this process, on --host and --registry-port."""
    registry_url, hosted, mesh_tls = config.registry, None, tls.load(config.tls, "scheduler")
    if registry_url == "local":
        hosted = await start_registry_server(config.host, config.registry_port, tls=mesh_tls)
        registry_url = f"local://{hosted.address}"
        print(f"registry ready on {hosted.address}", flush=True)
    try:
        await serve_scheduler(config, registry_url, mesh_tls)
    finally:
        if hosted:
            await hosted.stop()


def run_plan(config: PlanConfig) -> None:
    print(asyncio.run(print_plan(config.registry, config.model_name, tls.load(config.tls))))


@dataclass(frozen=True)
class Command:
    config: type
    """Every flag of the subcommand is a field of this dataclass (or of one nested in it)."""
    run: Callable[[Any], None]
    help: str


COMMANDS = {
    "stage": Command(StageConfig, run_stage, "serve a slice of a model's layers"),
    "router": Command(RouterConfig, run_router, "the front door: streams tokens through pipeline chains"),
    "registry": Command(RegistryConfig, run_registry, "the embedded registry on its own (one machine)"),
    "scheduler": Command(SchedulerConfig, run_scheduler, "place layers on the registered stages and publish chains"),
    "plan": Command(PlanConfig, run_plan, "print the scheduler's current plan and chains"),
    "up": Command(UpConfig, launcher.run_up, "start a scheduler, stage servers and a router on this machine, "
                  "and restart any that exits"),
    "roll": Command(RollConfig, run_roll, "restart every stage of a running `stagemesh up`, one by one, each "
                    "drained first: a rolling update without a failed request"),
    "certs": Command(CertsConfig, run_certs, "make a CA and one certificate per role (router, stage, scheduler, "
                     "client) for --tls"),
    "kernels": Command(KernelsConfig, run_kernels, "build the CPU kernels now (after install, or in an image "
                       "build), so that no stage's first start pays for it"),
    "bench": Command(BenchConfig, run_bench, "load a running router (gRPC or HTTP) and report TTFT, time per "
                     "output token, latencies, throughput and goodput"),
}


def _stop_with_parent() -> None:
    """A child of `stagemesh up` (stagemesh/processes.py) is told to stop (SIGTERM: it drains) when its parent
    dies, even by SIGKILL, instead of serving on as an orphan that nothing supervises. Linux only."""
    parent = os.environ.pop(PARENT_PID_ENV, "")  # for this process only, not for any it starts
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _logging_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --log-format, before the subcommand or after it (after it: only where given)."""
    env = os.environ.get
    parser.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower,
                        default=env("STAGEMESH_LOG_LEVEL", "info") if top else argparse.SUPPRESS,
                        help="how much to log (default: $STAGEMESH_LOG_LEVEL, else info)")
    parser.add_argument("--log-format", choices=tuple(LOG_FORMATS),
                        default=env("STAGEMESH_LOG_FORMAT", "json") if top else argparse.SUPPRESS,
                        help="json: one object per line, for a log pipeline; text: a line a person reads (default: "
                             "$STAGEMESH_LOG_FORMAT, else json)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagemesh", description="Distributed LLM inference over gRPC.")
    version = f"stagemesh {__version__}"
    p.add_argument("--version", action="version", version=version)
    _logging_flags(p, top=True)
    sub = p.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        parser = sub.add_parser(name, help=command.help, description=command.help)
        parser.add_argument("--version", action="version", version=version)
        parser.add_argument("--config", metavar="FILE", help="a TOML file of this command's settings (its keys are "
                            "the flags' fields; a flag given, then $STAGEMESH_<FLAG>, win over it)")
        _logging_flags(parser, top=False)
        add_flags(parser, command.config)
    return p


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word that is one (a value of a flag before it is not)."""
    takes_value = ("--log-level", "--log-format")
    return next((word for i, word in enumerate(argv)
                 if word in COMMANDS and (i == 0 or argv[i - 1] not in takes_value)), None)


def _config_file(argv: list[str]) -> dict:
    """The TOML file --config names in argv (STAGEMESH_CONFIG where none does), read; {} without either."""
    path = os.environ.get("STAGEMESH_CONFIG")
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif word.startswith("--config="):
            path = word.partition("=")[2]
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not TOML ({exc})") from None


def parse(argv: list[str]) -> argparse.Namespace:
    """argv's command and settings: flags given, then STAGEMESH_<FLAG> variables, then the --config file, then
    the defaults (stagemesh/config_flags.py, defaults_from)."""
    parser = build_parser()
    name = _subcommand(argv)
    if name is not None:
        data = _config_file(argv)
        for key in ("log_level", "log_format"):  # the file may set these too
            if key in data and f"--{key.replace('_', '-')}" not in argv:
                parser.set_defaults(**{key: data.pop(key)})
        defaults = defaults_from(COMMANDS[name].config, data, os.environ)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        sub.set_defaults(**defaults)
        for action in sub._actions:
            if action.dest in defaults:
                action.required = False  # the environment or the file gave it
        for old, new in deprecated_spellings(COMMANDS[name].config).items():
            if any(word == old or word.startswith(f"{old}=") for word in argv):
                print(f"stagemesh {name}: {old} is deprecated: use {new} (the old spelling goes in the next release)",
                      file=sys.stderr)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    _stop_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
    except (ValueError, OSError) as exc:
        print(f"stagemesh {_subcommand(argv) or ''}: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging(args.log_level, args.log_format)
    command = COMMANDS[args.command]
    try:
        command.run(from_args(command.config, args))
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"stagemesh {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
