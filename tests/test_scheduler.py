"""Stage servers register, the scheduler places layers and publishes chains, routers follow them."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from stagemesh import grpc_server
from stagemesh.checkpoint import ModelFootprint
from stagemesh.discovery.backends import open_registry
from stagemesh.registry.service import start_registry_server
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.scheduler.scheduler import Scheduler, SchedulerConfig
from stagemesh.scheduler.server import print_plan
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.server import StageServer
from stagemesh.stage_server.service.registration import Registration, RegistrationConfig
from stagemesh.v1 import router_pb2, router_pb2_grpc
from tests.conftest import collect, until


class ControlPlane:
    """A registry server, schedulers, registered stage servers and a router, all in this process."""

    def __init__(self, model):
        self.model = model
        self.footprint = ModelFootprint.from_model_dir(model)
        self.stages: list[tuple[StageServer, Registration]] = []
        self.schedulers: list[tuple[Scheduler, asyncio.Task]] = []
        self.closers = []

    async def start(self) -> ControlPlane:
        self.registry_server = await start_registry_server()
        self.url = f"local://{self.registry_server.address}"
        return self

    async def add_scheduler(self) -> Scheduler:
        scheduler = Scheduler(SchedulerConfig(model=str(self.model), lock_ttl_s=1.0), open_registry(self.url))
        self.schedulers.append((scheduler, asyncio.get_running_loop().create_task(scheduler.run())))
        return scheduler

    async def add_stage(self, share_of_model: float, model=None, registry_url: str = "") -> StageServer:
        """A stage without --layers whose memory holds this share of the model (besides KV headroom);
        `model` serves another checkpoint under the same name (another build); `registry_url` is how this stage
        reaches the registry (default: directly)."""
        budget = int(self.footprint.total_bytes * share_of_model / 0.8)
        registry_url = registry_url or self.url
        server = StageServer(StageConfig(model=str(model or self.model), registry=registry_url, port=0,
                                         kv_cache_gb=0.5))
        await server.start()
        registration = Registration(server, open_registry(registry_url),
                                    RegistrationConfig(self.model.name, budget, ttl_s=1.0), fixed=False)
        await registration.start()
        self.stages.append((server, registration))
        return server

    async def add_router(self) -> router_pb2_grpc.RouterStub:
        self.router = RouterServer(RouterConfig(model=str(self.model), registry=self.url, port=0,
                                                health_interval_s=0.2))
        await self.router.start()
        channel = grpc_server.insecure_channel(self.router.address)
        self.closers.append(channel.close)
        return router_pb2_grpc.RouterStub(channel)

    async def kill_stage(self, server: StageServer) -> None:
        """Like kill -9: it stops answering and stops heartbeating, without deregistering."""
        for s, registration in self.stages:
            if s is server:
                for task in registration._tasks:
                    task.cancel()
        await server.stop(0)

    async def stop(self) -> None:
        for close in self.closers:
            await close()
        if getattr(self, "router", None):
            await self.router.stop(0)
        for _, task in self.schedulers:
            task.cancel()
        for server, registration in self.stages:
            await self.stop_registration(registration)
            await server.stop(0)
        await self.stop_registry()

    async def stop_registration(self, registration) -> None:
        await registration.stop()

    async def stop_registry(self) -> None:
        await self.registry_server.stop(0)


async def wait_for_chains(stub, predicate, timeout: float = 60.0) -> list:
    """The router's healthy chains once they satisfy predicate, or as they are at the timeout (the caller asserts).
    The default bound covers a new leader's settling (--settle-s) and a tensor-parallel stage's rank processes
    starting on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        chains = [c for c in (await stub.ListChains(router_pb2.ListChainsRequest())).chains if c.healthy]
        if predicate(chains) or time.monotonic() > deadline:
            return chains
        await asyncio.sleep(0.1)


def layouts(chains) -> list[list[tuple[int, int]]]:
    return sorted([(s.layer_start, s.layer_end) for s in c.stages] for c in chains)


@pytest.fixture
async def plane(tiny_model):
    plane = await ControlPlane(tiny_model).start()
    yield plane
    await plane.stop()


async def test_model_that_fits_one_host_runs_as_whole_model_replicas(plane):
    await plane.add_scheduler()
    for _ in range(4):
        await plane.add_stage(share_of_model=1.5)
    stub = await plane.add_router()
    chains = await wait_for_chains(stub, lambda c: len(c) == 4)
    assert layouts(chains) == [[(0, 8)]] * 4
    listing = await stub.ListChains(router_pb2.ListChainsRequest())
    assert "layers 0:8" in listing.plan and "4 chain(s) published" in listing.plan  # it explains itself


async def test_the_plan_printed_lists_every_chain_it_announces(plane):
    """`stagemesh plan` while replicas join one after another: no snapshot of it announces a chain it does not
    list (the plan and the chains were two keys, written one after the other, and CI read between them)."""
    await plane.add_scheduler()
    snapshots: list[str] = []

    async def poll() -> None:
        for _ in range(5000):  # bounded; far more than the joins take
            snapshots.append(await print_plan(plane.url, plane.model.name))
            if "3 chain(s) published" in snapshots[-1]:
                return
            await asyncio.sleep(0)

    poller = asyncio.get_running_loop().create_task(poll())
    for _ in range(3):
        await plane.add_stage(share_of_model=1.5)
    await asyncio.wait_for(poller, 120)  # the poll is bounded too; this holds a machine 10x slower
    for printed in snapshots:
        announced = re.search(r"(\d+) chain\(s\) published", printed)
        listed = printed.count("(replica, tp width 1")
        assert listed == (int(announced[1]) if announced else 0), printed
    assert "3 chain(s) published" in snapshots[-1] and snapshots[-1].count("(replica, tp width 1") == 3


async def test_half_model_hosts_make_two_chains_of_two_and_share_traffic(plane):
    await plane.add_scheduler()
    servers = [await plane.add_stage(share_of_model=0.6) for _ in range(4)]
    stub = await plane.add_router()
    chains = await wait_for_chains(stub, lambda c: len(c) == 2)
    assert len(chains) == 2 and all(len(c.stages) == 2 for c in chains)
    assert all(c.stages[0].layer_start == 0 and c.stages[-1].layer_end == 8
               and c.stages[0].layer_end == c.stages[1].layer_start for c in chains)
    before = {s.address: s.batcher.batches_run for s in servers}
    for _ in range(10):
        await asyncio.gather(*(collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, i],
                                                                                max_new_tokens=4)))
                               for i in range(4)))
    first_stage_of = [c.stages[0].address for c in chains]
    counts = [next(s for s in servers if s.address == a).batcher.batches_run - before[a] for a in first_stage_of]
    share = counts[0] / sum(counts)
    assert 0.35 <= share <= 0.65, counts


async def test_dead_stage_is_withdrawn_and_a_spare_fills_the_gap(plane):
    await plane.add_scheduler()
    servers = [await plane.add_stage(share_of_model=0.6) for _ in range(4)]
    stub = await plane.add_router()
    assert len(await wait_for_chains(stub, lambda c: len(c) == 2)) == 2
    victim = servers[1]
    await plane.kill_stage(victim)
    t0 = time.monotonic()
    chains = await wait_for_chains(stub, lambda c: len(c) == 1, timeout=5)
    assert len(chains) == 1 and time.monotonic() - t0 < 5
    assert all(s.address != victim.address for s in chains[0].stages)
    ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=4)))
    assert ids
    await plane.add_stage(share_of_model=0.6)  # a spare joins: the broken chain is completed again
    assert len(await wait_for_chains(stub, lambda c: len(c) == 2)) == 2


async def test_standby_scheduler_takes_over_and_chains_keep_serving(plane):
    first = await plane.add_scheduler()
    await until(lambda: first.leading, 10, "the first scheduler leads")
    second = await plane.add_scheduler()
    for _ in range(2):
        await plane.add_stage(share_of_model=1.5)
    stub = await plane.add_router()
    assert len(await wait_for_chains(stub, lambda c: len(c) == 2)) == 2
    # One leads. Usually the first; on a loaded machine a renewal it could not make in time hands the lock over
    # (it stops acting before its lease can lapse), so the test takes whichever leads now.
    await until(lambda: first.leading != second.leading, 10, "exactly one scheduler leads")
    leader, standby = (0, second) if first.leading else (1, first)
    plane.schedulers[leader][1].cancel()  # the active scheduler dies without releasing its lock
    deadline = time.monotonic() + 5
    while not standby.leading and time.monotonic() < deadline:
        ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=2)))
        assert ids  # serving all along
        await asyncio.sleep(0.1)
    assert standby.leading
    await plane.add_stage(share_of_model=1.5)  # the new leader acts on changes
    assert len(await wait_for_chains(stub, lambda c: len(c) == 3)) == 3


async def test_router_keeps_its_chains_while_the_registry_is_unreachable(plane, caplog):
    await plane.add_scheduler()
    await plane.add_stage(share_of_model=1.5)
    stub = await plane.add_router()
    assert len(await wait_for_chains(stub, lambda c: len(c) == 1)) == 1
    await plane.registry_server.stop(0)
    await until(lambda: any(r.name == "stagemesh.router" and "registry unreachable" in r.getMessage()
                            for r in caplog.records), 30, "the router found the registry unreachable")
    for _ in range(3):
        ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=3)))
        assert ids
    assert len(await wait_for_chains(stub, lambda c: len(c) == 1, timeout=0)) == 1
    plane.registry_server = await start_registry_server()  # for stop()
