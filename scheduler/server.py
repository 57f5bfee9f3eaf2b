"""Processes of the control plane: `stagemesh registry` (the embedded registry on its own) and
`stagemesh scheduler` (which can also host the embedded registry, for a one-process start)."""

from __future__ import annotations

import asyncio

from scheduler.registry import open_registry, plan_key
from scheduler.registry_service import start_registry_server
from scheduler.scheduler import Scheduler, SchedulerConfig
from stagemesh.signals import until_signalled


async def serve_registry(host: str, port: int) -> None:
    server = await start_registry_server(host, port)
    print(f"registry ready on {server.address}", flush=True)
    await until_signalled()
    await server.stop()


async def serve_scheduler(config: SchedulerConfig, registry_url: str, host: str, registry_port: int) -> None:
    """registry_url "local" hosts the embedded registry here on registry_port."""
    hosted = None
    if registry_url == "local":
        hosted = await start_registry_server(host, registry_port)
        registry_url = f"local://{hosted.address}"
        print(f"registry ready on {hosted.address}", flush=True)
    registry = open_registry(registry_url)
    scheduler = Scheduler(config, registry)
    task = asyncio.get_running_loop().create_task(scheduler.run())
    print(f"scheduler ready ({config.scheduler_id}, registry {registry_url})", flush=True)
    await until_signalled()
    task.cancel()
    await scheduler.stop()
    await registry.close()
    if hosted:
        await hosted.stop()


async def print_plan(registry_url: str, model_name: str) -> str:
    from scheduler.chain_table import decode_chains
    from scheduler.registry import chains_key

    registry = open_registry(registry_url)
    try:
        plan, _ = await registry.kv_get(plan_key(model_name))
        chains, _ = await registry.kv_get(chains_key(model_name))
    finally:
        await registry.close()
    if plan is None:
        return f"no plan for model {model_name!r} in {registry_url}: is a scheduler running for it?"
    lines = [plan.decode(), "", "published chains:"]
    for chain in decode_chains(chains):
        lines.append(f"  {chain.chain_id}: {chain.label}")
    return "\n".join(lines)
