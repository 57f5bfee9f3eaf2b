"""`stagemesh up`: a whole mesh on one machine (a scheduler with the embedded registry, stage servers and a
router, each its own process), supervised: a process that exits is started again (stagemesh/supervisor.py).
Ctrl-C or SIGTERM stops everything, in order and gracefully (stagemesh/processes.py)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stagemesh.checkpoint import DtypeChoice, ModelFootprint, Quantization, read_config, serving_dtype
from stagemesh.config_flags import PORT_RULE, refused
from stagemesh.discovery.backends import plaintext_hosts
from stagemesh.processes import READY, LocalMesh, Process
from stagemesh.router.generation import GenerationConfig
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.supervisor import RestartPolicy, Supervisor
from stagemesh.tiny_model import make_tiny_model
from stagemesh.tls import INSECURE_FLAG, PlaintextConfig
from stagemesh.tls import load as load_tls
from stagemesh.v1 import router_pb2, router_pb2_grpc

__all__ = ["READY", "LocalMesh", "Process", "UpConfig", "run_up", "start_local_mesh", "wait_for_chains"]
STOP_MARGIN_S = 10.0
"""On stop, each group (router, stages, scheduler) gets its drain timeout and this long before it is killed."""


@dataclass
class UpConfig:
    """`stagemesh up`: a whole mesh on this machine, each process started with the flags below."""

    model: str | None = None
    """Checkpoint directory (default: make a tiny random one in models/tiny-llama)."""
    stages: int = 2
    """Pipeline stages per chain."""
    replicas: int = 1
    """Chains."""
    port: int = 50051
    """The router's port (0 picks a free port)."""
    http_port: int | None = None
    """The router's --http-port: serve the OpenAI-compatible HTTP API on this port too (default: none)."""
    dtype: DtypeChoice = "auto"
    """The stages' dtype (auto: the checkpoint's, a float32 checkpoint in bfloat16 on CUDA); the scheduler sizes
    weights as the stages announce them."""
    quantize: Quantization = "none"
    """int8 Linear weights in every stage (and the scheduler sizes them so)."""
    registry: str = "local"
    """local (embedded, one machine), consul://HOST:PORT, consul+https://HOST:PORT, etcd://HOST:PORT[,HOST:PORT...]
    or etcd+https://...: a scheduler places the layers."""
    prefill_chunk: int = GenerationConfig.prefill_chunk
    """The router's --prefill-chunk: prompt tokens per pipelined chunk (0: the whole prompt at once)."""
    max_batch_tokens: int | None = BatcherConfig.max_batch_tokens
    """The stages' --max-batch-tokens: the token budget of one forward pass (default: theirs, by device)."""
    threads: int | None = None
    """torch threads per stage (default: this machine's cores shared out over the float32 stages)."""
    drain_timeout_s: float = 30.0
    """The router's and the stages' --drain-timeout-s: on SIGTERM (Ctrl-C here, or `stagemesh roll`) each lets
    the streams it carries finish for up to this long; on stop, each is killed if still running this long
    (plus 10 s) after its SIGTERM."""
    restart_backoff_s: float = 0.5
    """A process that exits is started again after this long, doubled for each exit in a row that came
    soon after its start."""
    restart_backoff_max_s: float = 30.0
    """The longest wait before a restart."""
    restart_reset_s: float = 60.0
    """A process that ran this long before it exited is restarted after --restart-backoff-s again."""
    log_dir: str | None = None
    """Each process's log, and mesh.json (who runs where; `stagemesh roll` reads it), go here (default: a
    fresh temporary directory, printed)."""
    tls: str | None = None
    """Every process's --tls: mutual TLS between them with the certificates in this directory (`stagemesh certs
    DIR` makes them), and TLS on the router's port (default: plaintext)."""
    plaintext: PlaintextConfig = field(default_factory=PlaintextConfig)

    def __post_init__(self) -> None:
        if not self.stages >= 1:
            raise refused(self, "stages", "must be >= 1 stage per chain")
        if not self.replicas >= 1:
            raise refused(self, "replicas", "must be >= 1 chain")
        if not 0 <= self.port <= 65535:
            raise refused(self, "port", PORT_RULE)
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise refused(self, "http_port", "must be 0..65535 (0 or left out: no HTTP API)")
        if self.threads is not None and not self.threads >= 1:
            raise refused(self, "threads", "must be >= 1 (leave it out to share the cores out)")
        if not self.drain_timeout_s >= 0:
            raise refused(self, "drain_timeout_s", "must be >= 0 seconds (0: cut open streams at once)")
        if not self.restart_backoff_s > 0:
            raise refused(self, "restart_backoff_s", "must be > 0 seconds (a crashing process is not restarted in "
                                                     "a busy loop)")
        if not self.restart_backoff_max_s >= self.restart_backoff_s:
            raise refused(self, "restart_backoff_max_s", f"must be >= --restart-backoff-s {self.restart_backoff_s}")
        if not self.restart_reset_s > 0:
            raise refused(self, "restart_reset_s", "must be > 0 seconds of running")
        # Every process serves on loopback; a Consul or etcd elsewhere is dialled (its processes pass --insecure on).
        self.plaintext.refuse(self.tls, dials=plaintext_hosts(self.registry))
        # The router's and the stages' own bounds, checked here before any process starts.
        GenerationConfig(prefill_chunk=self.prefill_chunk)
        BatcherConfig(max_batch_tokens=self.max_batch_tokens)
        # Left out, the stages' budget is their device's (known to them, not here): the router then cuts prompts
        # into chunks no larger than it, and says so.
        if self.max_batch_tokens is not None and self.prefill_chunk > self.max_batch_tokens:
            raise ValueError(
                f"--prefill-chunk {self.prefill_chunk}: more than --max-batch-tokens {self.max_batch_tokens}, "
                "the most a stage runs in one pass (a larger chunk runs alone and holds other sessions' "
                "decoding back); lower --prefill-chunk or raise --max-batch-tokens")
        # --prefill-chunk 0 (no chunking) is allowed with any budget: it asks for whole prompts on purpose
        # (a prompt longer than the budget then runs alone), as the benchmarks' unchunked baseline does.


def even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    if not 1 <= stages <= num_layers:
        raise ValueError(f"--stages {stages}: must be between 1 and the model's {num_layers} layers")
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def stage_env(threads: int | None, shared_cores: bool = True) -> dict[str, str]:
    """shared_cores: torch processes whose threads outnumber the cores must not spin-wait on each other's cores
    (OMP_WAIT_POLICY=PASSIVE). One that has its cores to itself keeps OpenMP's default (spin a moment, then
    sleep): PASSIVE wakes a sleeping thread for every parallel region, and made a 2-thread decode step of the
    ~270M model 12% slower (bench_pass.py --medium --threads 2: 44.2 ms default, 49.6 ms PASSIVE)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if shared_cores:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env.pop("OMP_WAIT_POLICY", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def local_device_type() -> str:
    """"cuda" where this machine has an NVIDIA GPU (its driver's device list), else "cpu": what a stage's
    --device auto will choose, told without importing torch."""
    return "cuda" if Path("/proc/driver/nvidia/gpus").is_dir() and any(Path("/proc/driver/nvidia/gpus").iterdir()) \
        else "cpu"


def stage_budget_gb(model: str, stages: int, dtype: str, headroom: float = 0.2, quantize: str = "none") -> float:
    """A memory budget under which the scheduler needs exactly `stages` hosts for one chain."""
    total = ModelFootprint.from_model_dir(model, dtype, quantize).total_bytes
    share = 1.5 if stages == 1 else (1 + 0.5 / stages) / stages
    return total * share / (1 - headroom) / 2**30


def start_local_mesh(model: str, *, stages: int, replicas: int = 1, router_port: int = 50051,
                     dtype: str = "auto", quantize: str = "none", threads: int | None = None,
                     prefill_chunk: int = GenerationConfig.prefill_chunk,
                     extra_stage_args: list[str] | None = None, extra_router_args: list[str] | None = None,
                     registry: str | None = None, tls: str | None = None, insecure: bool = False,
                     log_dir: Path | None = None, ready_timeout_s: float = 120.0) -> tuple[LocalMesh, Process]:
    """Without registry: stages with fixed, even layer ranges and a router over them. With registry
    ("local", or a consul:// or etcd:// URL): a scheduler places layers on stages that announce a memory budget
    for `stages` stages per chain, and the router follows the chains it publishes. tls: every process's
    --tls directory; insecure: every process's --insecure (a plaintext Consul or etcd off loopback).
    ready_timeout_s: how long each process may take to be ready (loading its weights, and
    with --compile compiling in its warm-up: minutes on a large slice with inductor's cache cold)."""
    model_config = read_config(model)
    num_layers = model_config["num_hidden_layers"]  # as the stages read it (transformers' config: ~2 s)
    dtype = serving_dtype(dtype, model_config, local_device_type())  # as the stages will resolve auto
    mesh = LocalMesh(model, log_dir or Path(tempfile.mkdtemp(prefix="stagemesh-")))
    cpus = os.cpu_count() or 1
    lone: list[str] = []
    if threads is None:
        # Co-located stages share the cores (docs/decisions.md, "Threads"). float32 decode is bandwidth-bound: one
        # torch thread per stage beat two on 2 cores under many streams; a lone stream's stages take turns, and
        # the one whose turn it is takes the chain's cores (--lone-session-threads). A 16-bit GEMV on the CPU is
        # compute-bound on one thread (half the bandwidth), so the stages of a chain share the chain's cores.
        # OMP_WAIT_POLICY=PASSIVE (threads outnumber the cores) keeps the waiting stage off them.
        threads = max(1, cpus // (stages * replicas if dtype == "float32" else replicas))
        if dtype == "float32" and cpus // replicas > threads:
            lone = ["--lone-session-threads", str(cpus // replicas)]
    env = stage_env(threads, shared_cores=threads * stages * replicas > cpus or bool(lone))
    secure = ["--tls", tls] if tls else [INSECURE_FLAG] if insecure else []
    stage_args = ["stage", "--model", model, "--port", "0", "--dtype", dtype, "--threads", str(threads),
                  "--quantize", quantize, *lone, *secure, *(extra_stage_args or [])]
    # The scheduler sizes weights as the stages announce they hold them.
    sizing = secure
    router_args = ["router", "--model", model, "--port", str(router_port), "--prefill-chunk", str(prefill_chunk),
                   *secure, *(extra_router_args or [])]
    try:
        if registry:
            url = registry
            if registry == "local":
                proc = mesh.spawn("scheduler", ["scheduler", "--model", model, "--registry", "local",
                                                "--registry-port", "0", *sizing], env)
                url = f"local://{proc.address}"
            else:
                mesh.spawn("scheduler", ["scheduler", "--model", model, "--registry", url, *sizing], env)
            budget = f"{stage_budget_gb(model, stages, dtype, quantize=quantize):.6f}"
            # The stages and the router start side by side: they find each other through the registry.
            *_, router = mesh.spawn_together([
                *((f"stage-{i}", [*stage_args, "--registry", url, "--memory-gb", budget])
                  for i in range(stages * replicas)),
                ("router", [*router_args, "--registry", url])], env, ready_timeout_s)
            mesh.registry_url = url
        else:
            ranges = even_split(num_layers, stages)
            started = mesh.spawn_together([(f"stage-r{r}-s{i}", [*stage_args, "--layers", f"{a}:{b}"])
                                           for r in range(replicas) for i, (a, b) in enumerate(ranges)],
                                          env, ready_timeout_s)
            for r in range(replicas):
                router_args += ["--chain", ",".join(p.address for p in started[r * stages:(r + 1) * stages])]
            router = mesh.spawn("router", router_args, env)
    except BaseException:
        mesh.stop()
        raise
    return mesh, router


def wait_for_chains(router_address: str, count: int, timeout: float = 120.0, tls: str | None = None) -> list:
    """Waits until the router has `count` healthy chains; returns them. tls: the --tls directory, whose CA
    the router's certificate is checked against."""
    mesh_tls = load_tls(tls)
    deadline = time.monotonic() + timeout
    with (grpc.secure_channel(router_address, mesh_tls.channel_credentials()) if mesh_tls
          else grpc.insecure_channel(router_address)) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while True:
            chains = [c for c in stub.ListChains(router_pb2.ListChainsRequest(), timeout=5).chains if c.healthy]
            if len(chains) >= count or time.monotonic() > deadline:
                return chains
            time.sleep(0.2)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run_up(config: UpConfig) -> None:
    model = config.model or str(ensure_tiny_model(Path("models/tiny-llama")))
    log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="stagemesh-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    drain = ["--drain-timeout-s", str(config.drain_timeout_s)]
    http = ["--http-port", str(config.http_port)] if config.http_port else []
    budget = [] if config.max_batch_tokens is None else ["--max-batch-tokens", str(config.max_batch_tokens)]
    signal.signal(signal.SIGTERM, _interrupt)  # while starting, SIGTERM is Ctrl-C: what started is stopped
    load_tls(config.tls)  # a wrong directory stops here, not in every process
    mesh, router = start_local_mesh(model, stages=config.stages, replicas=config.replicas, router_port=config.port,
                                    dtype=config.dtype, quantize=config.quantize, registry=config.registry,
                                    prefill_chunk=config.prefill_chunk, threads=config.threads, log_dir=log_dir,
                                    tls=config.tls, insecure=config.plaintext.insecure,
                                    extra_stage_args=[*budget, *drain],
                                    extra_router_args=[*drain, *http])
    policy = RestartPolicy(config.restart_backoff_s, config.restart_backoff_max_s, config.restart_reset_s)
    supervisor = Supervisor(mesh, policy, info={"model": model, "router": router.address, "stages": config.stages,
                                                "replicas": config.replicas, "drain_timeout_s": config.drain_timeout_s})
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: no more waiting for drains
        stop.set()

    try:
        chains = wait_for_chains(router.address, config.replicas, tls=config.tls)
        supervisor.write_state()
        _print_welcome(model, mesh, router, chains, supervisor, config.tls, config.http_port)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGHUP, lambda *_: mesh.send_signal(signal.SIGHUP))  # reload: certificates, tokens
        supervisor.run(stop)
    finally:
        stop.set()  # from now on a signal kills at once
        print("stopping: the router first (it drains its streams), then the stages, then the scheduler", flush=True)
        try:
            mesh.shutdown(wait_s=config.drain_timeout_s + STOP_MARGIN_S)
        except KeyboardInterrupt:
            print("stopping now: killing every process", file=sys.stderr, flush=True)
            mesh.kill()
        supervisor.write_state(stopped=True)
        print("stopped", flush=True)


def _print_welcome(model: str, mesh: LocalMesh, router: Process, chains: list, supervisor: Supervisor,
                   tls: str | None, http_port: int | None = None) -> None:
    print(f"\nstagemesh is up for {model}; logs in {mesh.log_dir}")
    for proc in mesh.processes:
        print(f"  {proc.name:<12} {proc.address:<22} pid {proc.pid}")
    print(f"\n{len(chains)} chain(s):")
    for chain in chains:
        print(f"  {chain.chain_id}: " + " -> ".join(f"{s.address}[{s.layer_start}:{s.layer_end}]"
                                                    for s in chain.stages))
    secure = f" --tls {tls}" if tls else ""
    print(f"\nThe plan: stagemesh plan --model {model} --registry {mesh.registry_url}{secure}")
    grpcurl = f"grpcurl -cacert {Path(tls) / 'ca.pem'}" if tls else "grpcurl -plaintext"
    print(f"""
Call it:
  {grpcurl} {router.address} list
  {grpcurl} -d '{{"prompt": "Once upon a time", "max_new_tokens": 32}}' \\
      {router.address} stagemesh.v1.Router/Generate
  python scripts/generate_client.py --router {router.address} "Once upon a time"{_http_example(router, tls, http_port)}

A process that exits is started again (a stage rejoins through the registry); {supervisor.state_path} says
who runs where. Restart every stage, one by one, without a failed request:
  stagemesh roll --mesh {mesh.log_dir}

Ctrl-C (or SIGTERM) stops everything: the router drains first, then the stages, then the scheduler.""",
          flush=True)


def _http_example(router: Process, tls: str | None, http_port: int | None) -> str:
    """The welcome's lines for the OpenAI-compatible HTTP front, when it is on."""
    if not http_port:
        return ""
    host = router.address.rpartition(":")[0]
    scheme, ca = ("https", f" --cacert {Path(tls) / 'ca.pem'}") if tls else ("http", "")
    return (f"\n  curl{ca} {scheme}://{host}:{http_port}/v1/completions -H 'content-type: application/json' \\\n"
            f"      -d '{{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'")


def ensure_tiny_model(path: Path) -> Path:
    """The tiny model at `path`, made if missing. Made beside it and renamed into place, so that two processes
    that make it at once (two benchmarks, two `make run`) never read a half-written one."""
    if (path / "config.json").exists():
        return path
    print(f"making a tiny random model in {path} (no model hub needed)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-") as scratch:
        made = make_tiny_model(Path(scratch) / path.name, "llama")
        try:
            made.rename(path)
        except OSError:  # another process put its own there first: the same random model (seed 0)
            if not (path / "config.json").exists():
                raise
    return path
