"""A stage server in the registry: registers with its capacity, keeps its liveness, and (when started
without --layers) loads whatever range the scheduler assigns it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import socket
from dataclasses import dataclass

import torch

from stagemesh.discovery.registry import Registry, RegistryError, ServiceRecord, assignment_key, parse_layers
from stagemesh.stage_server.server import StageServer

log = logging.getLogger("stagemesh.stage")


@dataclass
class RegistrationConfig:
    model_name: str
    """The model's name in the registry, shared with the scheduler and routers."""
    budget_bytes: int
    """Memory this stage may fill with weights and KV cache: what the scheduler places by."""
    speed: float = 1.0
    """Relative throughput of this host (a weak host < 1): the scheduler gives it fewer layers."""
    ttl_s: float = 2.0
    """Missing heartbeats for this long make the stage critical: chains through it are withdrawn."""
    host_id: str = ""
    """The machine it runs on (meta "host"; default: this machine's hostname)."""
    devices: int = 1
    """Accelerator devices on that machine (meta "devices"): the scheduler may advise --tp where there are several."""

    def __post_init__(self) -> None:
        if not self.budget_bytes > 0:
            raise ValueError(f"budget_bytes {self.budget_bytes}: must be > 0 (the stage's --memory-gb)")
        if not self.speed > 0:
            raise ValueError(f"speed {self.speed}: must be > 0 (the stage's --speed)")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s {self.ttl_s}: must be > 0 seconds")
        if not self.devices >= 1:
            raise ValueError(f"devices {self.devices}: must be >= 1 (the stage's --devices)")
        self.host_id = self.host_id or socket.gethostname()


def local_devices(device: torch.device) -> int:
    """The accelerator devices a stage on `device` sees on its machine: CUDA's count on CUDA, else 1."""
    return torch.cuda.device_count() if device.type == "cuda" else 1


def stage_id(address: str) -> str:
    """The stage's id in the registry: its advertised address (unique across machines, unlike a bind
    address such as 0.0.0.0:50061) and a part fresh in every process start. A restarted process is a new
    stage (no sessions, perhaps another build of the model): it must not inherit its predecessor's
    registration, assignment or place in a plan, and two processes that announce one address by mistake
    show up as two registrations instead of overwriting each other's at every heartbeat."""
    return f"stage-{re.sub(r'[^A-Za-z0-9.-]+', '-', address).strip('-')}-{secrets.token_hex(4)}"


class Registration:
    def __init__(self, server: StageServer, registry: Registry, config: RegistrationConfig, fixed: bool):
        self.server = server
        self.registry = registry
        self.config = config
        self.fixed = fixed  # started with --layers: the scheduler uses it as it is
        self.service_id = stage_id(server.address)
        self._tasks: list[asyncio.Task] = []
        self._last_problem = ""

    def record(self) -> ServiceRecord:
        layers = self.server.layers
        return ServiceRecord(
            service_id=self.service_id,
            address=self.server.address,
            model=self.config.model_name,
            meta={
                "layers": f"{layers[0]}:{layers[1]}" if layers else "",
                "ready": "1" if layers else "0",
                "fixed": "1" if self.fixed else "0",
                "budget_bytes": str(self.config.budget_bytes),
                "speed": str(self.config.speed),
                "dtype": self.server.dtype,
                "quantize": self.server.config.quantize,
                "device": str(self.server.device),
                "fingerprint": self.server.fingerprint,
                "host": self.config.host_id,
                "devices": str(self.config.devices),
                "tp": str(self.server.config.tp),
            },
        )

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep_alive())]
        if not self.fixed:
            self._tasks.append(loop.create_task(self._follow_assignment()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        with contextlib.suppress(RegistryError):
            await self.registry.deregister(self.service_id)

    async def _register(self) -> None:
        await self.registry.register(self.record(), self.config.ttl_s)

    async def _keep_alive(self) -> None:
        registered = False
        while True:
            try:
                if not registered or not await self.registry.heartbeat(self.service_id):
                    await self._register()
                    if not registered:
                        log.info(f"registered as {self.service_id}", extra={"stage": self.server.address})
                    registered = True
            except RegistryError as exc:
                log.warning(f"registry unreachable, still serving: {exc}", extra={"stage": self.server.address})
                registered = False
            await asyncio.sleep(self.config.ttl_s / 4)

    async def _follow_assignment(self) -> None:
        index = 0
        key = assignment_key(self.config.model_name, self.service_id)
        while True:
            try:
                index, entry = await self.registry.watch_key(key, index, timeout_s=30)
            except RegistryError as exc:
                log.warning(f"cannot watch my assignment: {exc}", extra={"stage": self.server.address})
                await asyncio.sleep(1)
                continue
            try:
                await self._apply(entry.value if entry else b"")
            except Exception as exc:  # a bad value or a failed load: say so once, keep serving what it has
                message = f"cannot apply assignment {entry.value if entry else b''!r}: {exc}"
                if message != self._last_problem:
                    log.warning(message, extra={"stage": self.server.address}, exc_info=not isinstance(
                        exc, ValueError))
                    self._last_problem = message

    async def _apply(self, value: bytes) -> None:
        want = value.decode("utf-8", errors="replace")
        current = self.server.layers
        if not want or want == (f"{current[0]}:{current[1]}" if current else ""):
            return
        a, b = parse_layers(want, self.server.num_layers)
        log.info(f"assigned layers {a}:{b}: loading", extra={"stage": self.server.address})
        await self.server.swap(a, b)
        with contextlib.suppress(RegistryError):
            await self._register()  # tells the scheduler the range is loaded and serving
