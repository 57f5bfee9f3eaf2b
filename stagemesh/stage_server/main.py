"""A stage server's process: the server, and its registration when it has a registry."""

from __future__ import annotations

import logging
import time

import psutil

from stagemesh import metrics
from stagemesh.discovery.backends import open_registry
from stagemesh.signals import on_reload, until_signalled
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.server import StageServer
from stagemesh.stage_server.service.registration import Registration, RegistrationConfig, local_devices

log = logging.getLogger("stagemesh.stage")


async def serve(config: StageConfig) -> None:
    metrics.serve_metrics(config.metrics_port, config.host)
    server = StageServer(config)
    model = None
    try:
        if config.layer_start is not None:
            model = await server.in_compute(server.load, config.layer_start, config.layer_end)
        await server.start(model)
    except BaseException:  # e.g. a --kv-cache-gb the host cannot hold: the caller says why, in one line
        await server.stop(0)  # a grpc.aio server left to the interpreter's exit fails there, its loop gone
        raise
    registration = None
    if config.registry:
        budget = int(config.memory_gb * 2**30) if config.memory_gb else psutil.virtual_memory().available
        registration = Registration(server, open_registry(config.registry, server.tls),
                                    RegistrationConfig(config.model_name, budget, config.speed, host_id=config.host_id,
                                                       devices=config.devices or local_devices(server.device)),
                                    fixed=config.layer_start is not None)
        await registration.start()
    on_reload(server.tls and server.tls.reload)
    print(f"stage ready on {server.address}", flush=True)
    await until_signalled()
    # Drain: out of the registry (the scheduler withdraws its chains), NOT_SERVING, no new calls;
    # the sessions it holds finish, up to the drain timeout.
    t0 = time.monotonic()
    held = len(server.sessions) if server.sessions else 0
    log.info(f"stopping: draining {held} open session(s) for up to {config.drain_timeout_s:g}s "
             "(out of the registry, NOT_SERVING, no new calls)", extra={"stage": server.address})
    if registration:
        await registration.stop()
    await server.stop(config.drain_timeout_s)
    log.info(f"drained in {time.monotonic() - t0:.1f}s; exiting", extra={"stage": server.address})
