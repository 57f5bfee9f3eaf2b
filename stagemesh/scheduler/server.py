"""The scheduler's process: `stagemesh scheduler` (the CLI hosts the embedded registry next to it when
asked to) and `stagemesh plan`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh import metrics
from stagemesh.discovery.backends import open_registry, plaintext_hosts
from stagemesh.discovery.chain_table import decode_chains, published_plan
from stagemesh.discovery.registry import chains_key
from stagemesh.scheduler.scheduler import Scheduler, SchedulerConfig
from stagemesh.signals import on_reload, until_signalled
from stagemesh.tls import PlaintextConfig, Tls

log = logging.getLogger("stagemesh.scheduler")


@dataclass
class PlanConfig:
    """`stagemesh plan`: which registry to read the published plan from, for which model."""

    model: str
    """Local checkpoint directory (its name is the model's name by default)."""
    registry: str = "local://127.0.0.1:50050"
    """The registry the scheduler publishes to (local://HOST:PORT, consul://HOST:PORT, consul+https://HOST:PORT,
    etcd://HOST:PORT[,HOST:PORT...] or etcd+https://...)."""
    model_name: str = ""
    """The model's name in the registry (default: the checkpoint directory's name)."""
    tls: str | None = None
    """A directory with ca.pem, client.pem and client-key.pem (or a role-less mesh.pem): reach a registry that serves
    mutual TLS."""
    plaintext: PlaintextConfig = field(default_factory=PlaintextConfig)

    def __post_init__(self) -> None:
        self.model_name = self.model_name or Path(self.model).name
        self.plaintext.refuse(self.tls, dials=plaintext_hosts(self.registry))


async def serve_scheduler(config: SchedulerConfig, registry_url: str, tls: Tls | None = None) -> None:
    metrics.serve_metrics(config.metrics_port, config.host)
    registry = open_registry(registry_url, tls)
    scheduler = Scheduler(config, registry, tls)
    task = asyncio.get_running_loop().create_task(scheduler.run())
    on_reload(tls and tls.reload)  # the hosted registry serves the same Tls: one reload renews both
    print(f"scheduler ready ({config.scheduler_id}, registry {registry_url})", flush=True)
    await until_signalled()
    log.info("stopping: the leader lock is released for a standby")
    task.cancel()
    await scheduler.stop()
    await registry.close()


async def print_plan(registry_url: str, model_name: str, tls: Tls | None = None) -> str:
    registry = open_registry(registry_url, tls)
    try:
        chains, _ = await registry.kv_get(chains_key(model_name))
    finally:
        await registry.close()
    plan = published_plan(chains)
    if plan is None:
        return f"no plan for model {model_name!r} in {registry_url}: is a scheduler running for it?"
    lines = [plan, "", "published chains:"]
    for chain in decode_chains(chains):
        lines.append(f"  {chain.chain_id} ({chain.kind}, tp width {chain.tp_width}, model "
                     f"{chain.fingerprint or 'not announced'}): {chain.label}")
    return "\n".join(lines)
