"""A mesh on a real etcd: `stagemesh up --registry etcd://...` serves; on a 3-member cluster the mesh rides
out the etcd leader's SIGKILL (streams go on, the scheduler keeps or re-takes its lock, a stage killed
afterwards is withdrawn within 5 s and a spare fills in, the member rejoins), and the loss of quorum
(routers serve on their last chains, the scheduler stands down, the plan is left as it was)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.chain_table import decode_chains, published_plan
from stagemesh.discovery.registry import chains_key, holder_name, leader_key
from stagemesh.launcher import start_local_mesh, wait_for_chains
from stagemesh.scheduler.scheduler import Scheduler
from stagemesh.scheduler.server import print_plan
from stagemesh.v1 import router_pb2, router_pb2_grpc
from tests.conftest import collect
from tests.harness.etcd_cluster import EtcdCluster
from tests.test_scheduler import ControlPlane, layouts
from tests.test_scheduler import wait_for_chains as wait_for_router_chains

PROMPT = [5, 6, 7, 8]


class EtcdControlPlane(ControlPlane):
    """test_scheduler's control plane (schedulers, registered stages, a router, in this process) on an
    etcd cluster instead of the embedded registry."""

    def __init__(self, model, cluster: EtcdCluster):
        super().__init__(model)
        self.cluster = cluster

    async def start(self) -> EtcdControlPlane:
        self.url = self.cluster.url
        return self

    async def stop_registration(self, registration) -> None:
        """Its tasks cancelled, not deregistered: the cluster may have lost quorum, and etcd drops the
        stage's leases itself."""
        for task in registration._tasks:
            task.cancel()

    async def stop_registry(self) -> None:
        """Nothing: the test's cluster fixture stops etcd."""


class Streams:
    """Generations back to back, as a client would send them, until stopped; counts what came back."""

    def __init__(self, stub):
        self.stub, self.done, self.failures = stub, 0, []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                ids, _, _ = await collect(self.stub.Generate(
                    router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=6), timeout=30))
                self.done += 1 if len(ids) == 6 else 0
            except grpc.aio.AioRpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(0.05)

    async def served_since(self, count: int, within_s: float = 20.0) -> bool:
        deadline = time.monotonic() + within_s
        while self.done <= count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.done > count

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def until(check, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while not (result := await check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within_s} s")
        await asyncio.sleep(0.1)
    return result


@pytest.fixture
async def cluster(tmp_path):
    cluster = await asyncio.to_thread(EtcdCluster(tmp_path / "etcd", members=3).start)
    yield cluster
    await asyncio.to_thread(cluster.stop)


async def _leads(registry, scheduler: Scheduler) -> bool:
    with contextlib.suppress(Exception):
        return scheduler.leading and await registry.lock_holder(leader_key(scheduler.name)) == \
            holder_name(scheduler.holder_id)
    return False


async def test_mesh_survives_the_etcd_leader_dying_and_the_loss_of_quorum(tiny_model, cluster):
    plane = await EtcdControlPlane(tiny_model, cluster).start()
    registry = open_registry(cluster.url)
    streams = None
    try:
        scheduler = await plane.add_scheduler()
        servers = [await plane.add_stage(share_of_model=0.6) for _ in range(4)]
        stub = await plane.add_router()
        assert len(await wait_for_router_chains(stub, lambda c: len(c) == 2, timeout=30)) == 2
        streams = Streams(stub)
        assert await streams.served_since(0)

        # The etcd leader dies: the cluster elects another, nothing the mesh does stops.
        dead = cluster.leader()
        assert dead is not None
        await asyncio.to_thread(cluster.kill, dead)
        killed_at = streams.done
        await until(lambda: asyncio.to_thread(lambda: cluster.leader() not in (None, dead)), 20, "a new etcd leader")
        assert await streams.served_since(killed_at + 3), "streams must go on while etcd elects a leader"
        await until(lambda: _leads(registry, scheduler), 20, "the scheduler keeping or re-taking its lock")

        # A stage killed after that is still withdrawn within 5 s, and a spare fills the gap.
        victim = servers[1]
        await plane.kill_stage(victim)
        started = time.monotonic()
        chains = await wait_for_router_chains(stub, lambda c: len(c) == 1, timeout=5)
        assert len(chains) == 1 and time.monotonic() - started < 5
        assert all(s.address != victim.address for s in chains[0].stages)
        await plane.add_stage(share_of_model=0.6)
        assert len(await wait_for_router_chains(stub, lambda c: len(c) == 2, timeout=20)) == 2

        # The member comes back on its data and rejoins.
        await asyncio.to_thread(cluster.start_member, dead)
        assert await asyncio.to_thread(cluster.members_listed, dead) == 3
        assert all(await asyncio.to_thread(lambda: [cluster.healthy(i) for i in range(3)]))

        # Quorum lost: two of three members down.
        await until(lambda: _leads(registry, scheduler), 20, "the scheduler leading before quorum is lost")
        before, _ = await registry.kv_get(chains_key(scheduler.name))
        published = layouts(await wait_for_router_chains(stub, lambda c: len(c) == 2, timeout=0))
        leader = await until(lambda: asyncio.to_thread(lambda: [cluster.leader()] if cluster.leader() is not None
                                                       else None), 20, "an etcd leader")
        down = [i for i in range(3) if i != leader[0]]
        for i in down:
            await asyncio.to_thread(cluster.kill, i)
        lost_at = streams.done
        await until(lambda: asyncio.sleep(0, not scheduler.leading), 30, "the scheduler standing down")
        assert await streams.served_since(lost_at + 3), "routers must serve on their last chains without quorum"
        assert layouts(await wait_for_router_chains(stub, lambda c: len(c) == 2, timeout=0)) == published

        # Quorum back: the plan is as it was, and the scheduler leads again.
        for i in down:
            await asyncio.to_thread(cluster.start_member, i)
        await until(lambda: _leads(registry, scheduler), 30, "the scheduler leading again with quorum back")
        after, _ = await registry.kv_get(chains_key(scheduler.name))
        assert decode_chains(after) == decode_chains(before)
        assert published_plan(after)
        assert await streams.served_since(streams.done + 2)
        assert not streams.failures, streams.failures
    finally:
        if streams is not None:
            await streams.stop()
        await registry.close()
        await plane.stop()


def test_stagemesh_up_serves_with_an_etcd_registry(tiny_model, tmp_path):
    """`stagemesh up --registry etcd://...`: a scheduler, two stages and a router find each other in etcd."""
    cluster = EtcdCluster(tmp_path / "etcd").start()
    try:
        mesh, router = start_local_mesh(str(tiny_model), stages=2, router_port=0, registry=cluster.url,
                                        log_dir=tmp_path)
        try:
            chains = wait_for_chains(router.address, 1, timeout=90)
            assert [(s.layer_start, s.layer_end) for s in chains[0].stages] == [(0, 4), (4, 8)]
            with grpc.insecure_channel(router.address) as channel:
                ids = [t for r in router_pb2_grpc.RouterStub(channel).Generate(
                    router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=4), timeout=60) for t in r.token_ids]
            assert len(ids) == 4
            plan = asyncio.run(print_plan(cluster.url, tiny_model.name, None))  # `stagemesh plan --registry etcd://`
            assert "published chains:" in plan and "chain" in plan.split("published chains:")[1]
        finally:
            mesh.stop()
    finally:
        cluster.stop()
