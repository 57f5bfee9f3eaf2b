"""Starts a stage server: loads its slice, sizes its KV pool, serves Stage + health + reflection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import torch
from grpc_health.v1 import health_pb2

from stage_server.batcher import BatcherConfig, StepBatcher
from stage_server.kv_pool import KVPool
from stage_server.loader import load_stage
from stage_server.model import StageModel, StepSlice
from stage_server.quantize import loads_int8_weights, quantize
from stage_server.sessions import SessionTable, short_id
from stage_server.stage_service import ERROR_CODES, StageService
from stagemesh import grpc_server, metrics
from stagemesh.checkpoint import (
    QUANTIZE,
    Quantization,
    ServingDtype,
    model_fingerprint,
    read_config,
    serving_fingerprint,
)
from stagemesh.config_flags import PORT_RULE, refused
from stagemesh.errors import StatusError, StatusInterceptor
from stagemesh.tracing import TracingConfig
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.stage")
SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STEP_HEADROOM_BYTES = 1 << 20
"""Room in a Forward message besides its hidden states: framing, ids, sampling, a row scale per token."""


def max_step_bytes(max_batch_tokens: int, hidden_size: int) -> int:
    """The largest Forward message a stage accepts: a whole pass's hidden states in float32 (the widest
    wire dtype) and headroom. Routers send no larger chunk; anything larger is refused by gRPC
    (RESOURCE_EXHAUSTED) from its length prefix, before it is buffered."""
    return max_batch_tokens * hidden_size * 4 + STEP_HEADROOM_BYTES


def parse_layers(spec: str) -> tuple[int, int | None]:
    """--layers A:B -> (A, B); "A:" runs through the last layer."""
    try:
        a, b = spec.split(":")
        return int(a), (int(b) if b else None)
    except ValueError:
        raise ValueError("use A:B (layers A..B-1), e.g. 0:4") from None


def split_host_port(text: str) -> tuple[str, int | None]:
    """--advertise: "HOST", "HOST:PORT", "[V6]" or "[V6]:PORT" -> (host, port or None); a bare IPv6
    address is a host."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or rest[:1] not in ("", ":"):
            raise ValueError("use HOST, HOST:PORT or [IPv6]:PORT")
        port = rest[1:] or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None
    if not host or grpc_server.is_wildcard(host):
        raise ValueError("give the host others reach this stage at, not a wildcard")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"port {port!r} must be 1..65535")
    return host, int(port) if port else None


@dataclass
class StageConfig:
    model: str
    """Local Hugging Face checkpoint directory (config.json + safetensors)."""
    layer_start: int | None = field(default=None, metadata={"flag": "--layers", "type": parse_layers,
                                                            "metavar": "A:B"})
    """A:B serves decoder layers A..B-1 (default: the scheduler assigns a range; needs --registry)."""
    layer_end: int | None = field(default=None, metadata={"flag": "--layers"})
    """None: through the last layer."""
    host: str = "127.0.0.1"
    """The address to serve on (a wildcard such as 0.0.0.0 or :: needs --advertise)."""
    port: int = 0
    """0 picks a free port."""
    advertise: str = field(default="", metadata={"metavar": "HOST[:PORT]"})
    """The address others reach this stage at: registered in the registry, shown in logs, part of the
    stage's id (default: --host and the bound port; PORT defaults to the bound port)."""
    device: str = "auto"
    """auto, cpu or cuda (cuda:N for one of several)."""
    dtype: ServingDtype = "float32"
    """The dtype the weights and the KV cache are held in."""
    kv_cache_gb: float | None = None
    """KV cache pool size (default: a quarter of the memory available at start)."""
    session_timeout_s: float = field(default=300.0, metadata={"flag": "--session-timeout"})
    """Seconds after which an idle session is closed and its cache freed."""
    unstepped_session_timeout_s: float = 30.0
    """Seconds after which a session opened and never stepped is closed: opening sessions without
    stepping them must not hold the KV pool for the whole idle timeout. Longer than the first step of
    a session can take to reach this stage (a long prompt's first chunk through the stages before it)."""
    stall_timeout_s: float = 30.0
    """Health turns NOT_SERVING while steps wait and no pass has finished for this long (a stuck
    compute thread), so that routers stop sending it work; it turns back when passes finish again."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: out of the registry and NOT_SERVING at once, no new sessions, and this long for
    the sessions it holds to finish before the process exits (those left are cut: routers replay them)."""
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (default: none): passes, tokens, sessions, KV pool, wire bytes."""
    threads: int | None = None
    """torch intra-op threads (default: torch's choice)."""
    registry: str | None = None
    """local://HOST:PORT or consul://HOST:PORT: announce this stage there (needed without --layers)."""
    model_name: str = ""
    """The model's name in the registry (default: the checkpoint directory's name)."""
    memory_gb: float | None = None
    """Memory budget announced to the scheduler (default: the memory available at start)."""
    speed: float = 1.0
    """Relative speed announced to the scheduler: a host half as fast says 0.5 and gets fewer layers."""
    quantize: Quantization = "none"
    """int8: Linear weights in int8 (int8 kernels on CPU float32, weight-only elsewhere); int8-weight-only:
    the portable path on any device (stage_server/quantize.py; the README gives the accuracy cost)."""
    preload: bool = False
    """Read every weight page at start, so that no request pays for a cold page (tensors used as stored
    are otherwise views of the memory-mapped safetensors file, read on first use); Stage/Info reports
    the load time as cold start."""

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: use one of {', '.join(TORCH_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device {self.device!r}: use auto, cpu or cuda")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"--quantize {self.quantize!r}: use one of {', '.join(QUANTIZE)}")
        if self.layer_start is not None and not (
                self.layer_start >= 0 and (self.layer_end is None or self.layer_end > self.layer_start)):
            raise ValueError(f"--layers {self.layer_start}:{self.layer_end}: use A:B with 0 <= A < B "
                             "(layers A..B-1), e.g. 0:4")
        if self.layer_start is None and not self.registry:
            raise ValueError("give --layers A:B, or --registry so that the scheduler assigns a range")
        if not 0 <= self.port <= 65535:
            raise refused(self, "port", PORT_RULE)
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise refused(self, "kv_cache_gb", "must be > 0 GiB (leave it out for a quarter of the available memory)")
        if not self.session_timeout_s > 0:
            raise refused(self, "session_timeout_s", "must be > 0 seconds (how long an idle session keeps its cache)")
        if not self.unstepped_session_timeout_s > 0:
            raise refused(self, "unstepped_session_timeout_s", "must be > 0 seconds (longer than a router takes "
                                                               "from opening a session to its first step)")
        if self.advertise:
            try:
                split_host_port(self.advertise)
            except ValueError as exc:
                raise refused(self, "advertise", str(exc)) from None
        elif not self.host or grpc_server.is_wildcard(self.host):
            raise refused(self, "host", "listens on every interface, which is no address others can reach; "
                                        "give --advertise HOST[:PORT], the address to register and reach it at")
        if not self.stall_timeout_s > 0:
            raise refused(self, "stall_timeout_s", "must be > 0 seconds (longer than the slowest honest pass)")
        if not self.drain_timeout_s >= 0:
            raise refused(self, "drain_timeout_s", "must be >= 0 seconds (0: cut open sessions at once)")
        if self.threads is not None and not self.threads >= 1:
            raise refused(self, "threads", "must be >= 1 (leave it out for torch's choice)")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise refused(self, "memory_gb", "must be > 0 GiB (leave it out to announce the memory available "
                                             "at start)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise refused(self, "metrics_port", "must be 0..65535 (left out: no metrics)")
        if not self.speed > 0:
            raise refused(self, "speed", "must be > 0 (a relative speed; 1.0 is an ordinary host)")
        self.model_name = self.model_name or Path(self.model).name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return psutil.virtual_memory().available // 4


class StageSlot(stage_pb2_grpc.StageServicer):
    """The Stage service of a server that may not hold layers yet (waiting for the scheduler to
    assign a range) or may be reloading: it hands calls to the current StageService or says why not."""

    def __init__(self) -> None:
        self.current: StageService | None = None
        self.draining = False
        """Stopping: no new session; the open streams go on until they end or the drain timeout cuts them."""
        self.streams = 0
        """Forward streams whose handlers are running."""

    def _service(self) -> StageService:
        if self.current is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              "this stage holds no layers yet: it is waiting for the scheduler to assign a range")
        return self.current

    async def OpenSession(self, request, context):
        if self.draining:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              "this stage is draining (stopping): it takes no new session; use another chain")
        return await self._service().OpenSession(request, context)

    async def CloseSession(self, request, context):
        return await self._service().CloseSession(request, context)

    async def Forward(self, request_iterator, context):
        self.streams += 1
        try:
            # Closed with this stream, not when collected: the service's Forward closes its sessions then.
            async with contextlib.aclosing(self._service().Forward(request_iterator, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.streams -= 1

    async def Info(self, request, context):
        return await self._service().Info(request, context)


def warm_up(model: StageModel, pool: KVPool) -> float:
    """One pass over a scratch session before the stage says SERVING, so that the first caller does
    not pay for first-use costs (allocator growth, kernel selection); returns its seconds."""
    t0 = time.perf_counter()
    cache = pool.allocate(2)
    try:
        inputs = (torch.zeros(1, dtype=torch.long, device=model.device) if model.is_first
                  else torch.zeros(1, model.args.hidden_size, dtype=model.dtype, device=model.device))
        model(inputs, [StepSlice(cache, 0, 0, 1)])
    finally:
        pool.release(cache)
    return time.perf_counter() - t0


class StageServer:
    """A gRPC server that is up (and alive for the registry) before it holds layers; load() then
    activate() give it a slice. Health: "" is SERVING while the process lives, SERVICE_NAME only
    while a slice is loaded and serving."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.device = resolve_device(config.device)
        model_config = read_config(config.model)
        self.num_layers = model_config["num_hidden_layers"]
        # What this stage serves (checkpoint.serving_fingerprint): registered, and in Stage/Info.
        self.fingerprint = serving_fingerprint(model_fingerprint(config.model), config.dtype, config.quantize)
        self.server = grpc_server.new_server(
            [StatusInterceptor(log, ERROR_CODES)],
            max_step_bytes(config.batcher.max_batch_tokens, model_config["hidden_size"]))
        self.slot = StageSlot()
        stage_pb2_grpc.add_StageServicer_to_server(self.slot, self.server)
        self.health = grpc_server.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = grpc_server.bind(self.server, config.host, config.port)
        host, port = split_host_port(config.advertise) if config.advertise else (config.host, None)
        # Where others reach this stage (--advertise, else the bind address): registered and logged.
        self.address = grpc_server.host_port(host, port or self.port)
        self.model: StageModel | None = None
        self.pool: KVPool | None = None
        self.sessions: SessionTable | None = None
        self.batcher: StepBatcher | None = None
        self.stalled = False
        self._tasks: list[asyncio.Task] = []

    @property
    def bind_address(self) -> str:
        return grpc_server.host_port(self.config.host, self.port)

    @property
    def layers(self) -> tuple[int, int] | None:
        return (self.model.layer_start, self.model.layer_end) if self.model else None

    def load(self, layer_start: int, layer_end: int | None) -> StageModel:
        """Reads the slice's weights (blocking: call it off the event loop when serving)."""
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        t0 = time.perf_counter()
        dtype = TORCH_DTYPES[self.config.dtype]
        model = load_stage(self.config.model, layer_start, layer_end, dtype=dtype, device=self.device,
                           int8_linears=loads_int8_weights(self.config.quantize, self.device.type, dtype))
        model = quantize(model, self.config.quantize)  # torch.ao's path on CPU float32; else done at load
        if self.config.preload:
            with torch.inference_mode():
                for p in model.parameters():
                    p.sum()  # touches every page of the weights
        model.load_s = time.perf_counter() - t0
        rss = psutil.Process().memory_info().rss
        log.info(f"loaded layers {model.layer_start}:{model.layer_end} in {model.load_s:.2f}s, "
                 f"{sum(p.nbytes for p in model.parameters()) / 2**20:.0f} MiB of weights, process RSS "
                 f"{rss / 2**20:.0f} MiB "
                 f"(cold start{', preloaded' if self.config.preload else ''}, before serving)",
                 extra={"stage": self.address})
        return model

    async def activate(self, model: StageModel) -> None:
        """Serves model from now on; sessions of a previous slice are closed."""
        await self.deactivate()
        config, args = self.config, model.args
        kv_bytes = int(config.kv_cache_gb * 2**30) if config.kv_cache_gb else default_kv_bytes(model.device)
        self.pool = KVPool(kv_bytes, len(model.layers), args.num_kv_heads, args.head_dim, model.dtype, model.device)
        warm_s = await asyncio.to_thread(warm_up, model, self.pool)
        log.info(f"warm-up pass in {warm_s * 1000:.0f} ms", extra={"stage": self.address})
        self.sessions = SessionTable(self.pool, args.max_position)
        self.batcher = StepBatcher(model, config.batcher)
        self.batcher.start()
        self.model = model
        self.slot.current = StageService(model, self.sessions, self.batcher, config.model_name, self.fingerprint,
                                         self.address)
        await grpc_server.set_serving(self.health, [SERVICE_NAME], True)
        bound = f", bound to {self.bind_address}" if self.bind_address != self.address else ""
        log.info(
            f"stage serving layers {model.layer_start}:{model.layer_end} of {args.num_layers} on {self.address}"
            f"{bound} ({model.dtype}, {model.device}, model {self.fingerprint})",
            extra={"stage": self.address},
        )

    async def deactivate(self) -> None:
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.slot.current = None
        if self.batcher:
            await self.batcher.stop()
        if self.sessions:
            for sid in list(self.sessions.sessions):
                self.sessions.close(sid)
        self.model = None

    async def start(self, model: StageModel | None = None) -> None:
        """Starts serving: model's slice at once if given, else nothing until activate()."""
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reap_idle()), loop.create_task(self._watch_progress())]
        if model is not None:
            await self.activate(model)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Drains, then stops: NOT_SERVING and no new session at once (health checks and Info are still
        answered, so routers see why); the open streams (sessions) get `grace` seconds to end, and those left
        then are cut (routers replay them elsewhere)."""
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        self.slot.draining = True
        for task in self._tasks:
            task.cancel()
        if grace:
            await self._drain(grace)
        # The streams ended before the server stops: a stream's end that raced the server's shutdown was
        # seen by its handler as the server gone (an error, logged as one).
        await self.server.stop(0)
        await self.deactivate()

    async def _drain(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self.slot.streams or (self.sessions and len(self.sessions))) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.slot.streams:
            log.warning(f"drain timeout: cutting {self.slot.streams} stream(s) still open after {timeout:g}s",
                        extra={"stage": self.address})

    async def _reap_idle(self) -> None:
        """Closes idle sessions, and unstepped ones soon: ticks at a quarter of the shorter timeout (at
        most a second), so that a session outlives its timeout by little."""
        timeout, unstepped = self.config.session_timeout_s, self.config.unstepped_session_timeout_s
        period = min(1.0, min(timeout, unstepped) / 4)
        while True:
            await asyncio.sleep(period)
            if self.sessions is None:
                continue
            for sid in self.sessions.expire_idle(timeout, unstepped):
                log.info("session expired", extra={"session_id": short_id(sid)})

    def _export_gauges(self) -> None:
        if self.sessions is None or self.pool is None or self.batcher is None:
            return
        metrics.OPEN_SESSIONS.set(len(self.sessions))
        metrics.KV_USED_BYTES.set(self.pool.used_bytes)
        metrics.KV_FREE_BYTES.set(self.pool.capacity_bytes - self.pool.used_bytes)
        metrics.QUEUED_STEPS.set(self.batcher.queued)

    async def _watch_progress(self) -> None:
        """The watchdog: a stage whose event loop answers health checks while its compute thread is
        stuck must not look healthy ("healthy but dead")."""
        limit = self.config.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            self._export_gauges()
            stalled = self.batcher is not None and self.batcher.stalled_for() > limit
            if stalled == self.stalled or self.model is None:
                continue
            self.stalled = stalled
            metrics.STALLED.set(int(stalled))
            if stalled:
                log.error(f"no forward pass finished in {limit:.0f}s with steps waiting: NOT_SERVING until one does",
                          extra={"stage": self.address})
            else:
                log.info("forward passes finish again: SERVING", extra={"stage": self.address})
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                                  else health_pb2.HealthCheckResponse.SERVING)
