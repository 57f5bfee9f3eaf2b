"""Starts a stage server: loads its slice, sizes its KV pool, serves Stage + health + reflection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from stage_server.batcher import BatcherConfig, StepBatcher
from stage_server.kv_pool import KVPool
from stage_server.model import StageModel, load_stage
from stage_server.sessions import SessionTable
from stage_server.stage_service import StageService
from stagemesh import grpc_server
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.stage")
SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StageConfig:
    model: str
    """Local Hugging Face checkpoint directory (config.json + safetensors)."""
    layer_start: int
    layer_end: int | None = None
    """None: through the last layer."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port."""
    device: str = "auto"
    """auto, cpu or cuda."""
    dtype: str = "float32"
    kv_cache_gb: float | None = None
    """KV pool size; None takes a quarter of the memory available at start."""
    session_timeout_s: float = 300.0
    """A session not stepped for this long is closed and its cache freed."""
    batch_window_ms: float = 0.0
    max_batch_tokens: int = 2048
    threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: use one of {', '.join(TORCH_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device {self.device!r}: use auto, cpu or cuda")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError("--kv-cache-gb must be positive")
        if self.session_timeout_s <= 0:
            raise ValueError("--session-timeout must be positive")


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


class StageServer:
    def __init__(self, config: StageConfig, model: StageModel):
        self.config = config
        self.model = model
        args = model.args
        kv_bytes = (
            int(config.kv_cache_gb * 2**30) if config.kv_cache_gb else default_kv_bytes(model.device)
        )
        self.pool = KVPool(kv_bytes, len(model.layers), args.num_kv_heads, args.head_dim, model.dtype,
                           model.device)
        self.sessions = SessionTable(self.pool, args.max_position)
        self.batcher = StepBatcher(
            model, BatcherConfig(config.batch_window_ms / 1000, config.max_batch_tokens)
        )
        self.server = grpc_server.new_server()
        self.service = StageService(model, self.sessions, self.batcher, Path(config.model).name)
        stage_pb2_grpc.add_StageServicer_to_server(self.service, self.server)
        self.health = grpc_server.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = grpc_server.bind(self.server, config.host, config.port)
        self._reaper: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        self.batcher.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())
        await grpc_server.set_serving(self.health, [SERVICE_NAME], True)
        log.info(
            f"stage serving layers {self.model.layer_start}:{self.model.layer_end} of "
            f"{self.model.args.num_layers} on {self.address} ({self.model.dtype}, {self.model.device})",
            extra={"stage": self.address},
        )

    async def stop(self, grace: float | None = 1.0) -> None:
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        if self._reaper:
            self._reaper.cancel()
        await self.server.stop(grace)
        await self.batcher.stop()
        for sid in list(self.sessions.sessions):
            self.sessions.close(sid)

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def _reap_idle(self) -> None:
        period = min(5.0, self.config.session_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            for sid in self.sessions.expire_idle(self.config.session_timeout_s):
                log.info("session expired", extra={"session_id": sid})


def build_stage(config: StageConfig) -> StageServer:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    model = load_stage(config.model, config.layer_start, config.layer_end,
                       dtype=TORCH_DTYPES[config.dtype], device=device)
    return StageServer(config, model)


async def serve(config: StageConfig) -> None:
    server = build_stage(config)
    await server.start()
    print(f"stage ready on {server.address}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
