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
from stage_server.model import StageModel
from stage_server.quantize import loads_int8_weights, quantize
from stage_server.sessions import SessionTable
from stage_server.stage_service import ERROR_CODES, StageService
from stagemesh import grpc_server, tls
from stagemesh.checkpoint import QUANTIZE, Quantization, ServingDtype, read_config
from stagemesh.config_flags import PORT_RULE, refused
from stagemesh.errors import StatusError, StatusInterceptor
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.stage")
SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_layers(spec: str) -> tuple[int, int | None]:
    """--layers A:B -> (A, B); "A:" runs through the last layer."""
    try:
        a, b = spec.split(":")
        return int(a), (int(b) if b else None)
    except ValueError:
        raise ValueError("use A:B (layers A..B-1), e.g. 0:4") from None


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
    """The address to serve on."""
    port: int = 0
    """0 picks a free port."""
    device: str = "auto"
    """auto, cpu or cuda (cuda:N for one of several)."""
    dtype: ServingDtype = "float32"
    """The dtype the weights and the KV cache are held in."""
    kv_cache_gb: float | None = None
    """KV cache pool size (default: a quarter of the memory available at start)."""
    session_timeout_s: float = field(default=300.0, metadata={"flag": "--session-timeout"})
    """Seconds after which an idle session is closed and its cache freed."""
    stall_timeout_s: float = 30.0
    """Health turns NOT_SERVING while steps wait and no pass has finished for this long (a stuck
    compute thread), so that routers stop sending it work; it turns back when passes finish again."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: out of the registry and NOT_SERVING at once, no new sessions, and this long for
    the sessions it holds to finish before the process exits (those left are cut: routers replay them)."""
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    threads: int | None = None
    """torch intra-op threads (default: torch's choice)."""
    registry: str | None = None
    """local://HOST:PORT, consul://HOST:PORT or consul+https://HOST:PORT: announce this stage there (needed
    without --layers)."""
    tls: str | None = None
    """A directory with ca.pem, mesh.pem and mesh-key.pem (`stagemesh certs`): serve mutual TLS (callers need a
    certificate from that CA) and reach the registry with it (default: plaintext)."""
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
        if not self.stall_timeout_s > 0:
            raise refused(self, "stall_timeout_s", "must be > 0 seconds (longer than the slowest honest pass)")
        if not self.drain_timeout_s >= 0:
            raise refused(self, "drain_timeout_s", "must be >= 0 seconds (0: cut open sessions at once)")
        if self.threads is not None and not self.threads >= 1:
            raise refused(self, "threads", "must be >= 1 (leave it out for torch's choice)")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise refused(self, "memory_gb", "must be > 0 GiB (leave it out to announce the memory available "
                                             "at start)")
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

    def _service(self) -> StageService:
        if self.current is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              "this stage holds no layers yet: it is waiting for the scheduler to assign a range")
        return self.current

    async def OpenSession(self, request, context):
        return await self._service().OpenSession(request, context)

    async def CloseSession(self, request, context):
        return await self._service().CloseSession(request, context)

    async def Forward(self, request_iterator, context):
        # Closed with this stream, not when collected: the service's Forward closes its sessions then.
        async with contextlib.aclosing(self._service().Forward(request_iterator, context)) as responses:
            async for response in responses:
                yield response

    async def Info(self, request, context):
        return await self._service().Info(request, context)


class StageServer:
    """A gRPC server that is up (and alive for the registry) before it holds layers; load() then
    activate() give it a slice. Health: "" is SERVING while the process lives, SERVICE_NAME only
    while a slice is loaded and serving."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.tls = tls.load(config.tls)  # first: a wrong --tls stops the process before any weights are read
        self.device = resolve_device(config.device)
        self.num_layers = read_config(config.model)["num_hidden_layers"]
        self.server = grpc_server.new_server([StatusInterceptor(log, ERROR_CODES)])
        self.slot = StageSlot()
        stage_pb2_grpc.add_StageServicer_to_server(self.slot, self.server)
        self.health = grpc_server.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = grpc_server.bind(self.server, config.host, config.port,
                                     self.tls.server_credentials() if self.tls else None)
        self.model: StageModel | None = None
        self.pool: KVPool | None = None
        self.sessions: SessionTable | None = None
        self.batcher: StepBatcher | None = None
        self.stalled = False
        self._tasks: list[asyncio.Task] = []

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

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
        log.info(f"loaded layers {model.layer_start}:{model.layer_end} in {model.load_s:.2f}s "
                 f"(cold start{', preloaded' if self.config.preload else ''}, before serving)",
                 extra={"stage": self.address})
        return model

    async def activate(self, model: StageModel) -> None:
        """Serves model from now on; sessions of a previous slice are closed."""
        await self.deactivate()
        config, args = self.config, model.args
        kv_bytes = int(config.kv_cache_gb * 2**30) if config.kv_cache_gb else default_kv_bytes(model.device)
        self.pool = KVPool(kv_bytes, len(model.layers), args.num_kv_heads, args.head_dim, model.dtype, model.device)
        self.sessions = SessionTable(self.pool, args.max_position)
        self.batcher = StepBatcher(model, config.batcher)
        self.batcher.start()
        self.model = model
        self.slot.current = StageService(model, self.sessions, self.batcher, config.model_name)
        await grpc_server.set_serving(self.health, [SERVICE_NAME], True)
        log.info(
            f"stage serving layers {model.layer_start}:{model.layer_end} of {args.num_layers} on {self.address} "
            f"({model.dtype}, {model.device})",
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
        """NOT_SERVING at once, no new calls; open streams (sessions) get `grace` seconds to finish."""
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        for task in self._tasks:
            task.cancel()
        await self.server.stop(grace)
        await self.deactivate()

    async def _reap_idle(self) -> None:
        period = min(5.0, self.config.session_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            if self.sessions is None:
                continue
            for sid in self.sessions.expire_idle(self.config.session_timeout_s):
                log.info("session expired", extra={"session_id": sid})

    async def _watch_progress(self) -> None:
        """The watchdog: a stage whose event loop answers health checks while its compute thread is
        stuck must not look healthy ("healthy but dead")."""
        limit = self.config.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            stalled = self.batcher is not None and self.batcher.stalled_for() > limit
            if stalled == self.stalled or self.model is None:
                continue
            self.stalled = stalled
            if stalled:
                log.error(f"no forward pass finished in {limit:.0f}s with steps waiting: NOT_SERVING until one does",
                          extra={"stage": self.address})
            else:
                log.info("forward passes finish again: SERVING", extra={"stage": self.address})
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                                  else health_pb2.HealthCheckResponse.SERVING)
