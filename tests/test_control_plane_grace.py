"""A hiccup of the control plane is not an outage: stages whose path to the registry goes silent keep their
chains while they serve, and a router does not adopt a table that takes most of its working capacity away."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.chain_table import decode_chains, encode_chains
from stagemesh.discovery.registry import ServiceRecord, assignment_key, assignments_prefix, chains_key, leader_key
from stagemesh.registry.service import start_registry_server
from stagemesh.scheduler.scheduler import LeaseLapsing, Scheduler, SchedulerConfig
from stagemesh.v1 import router_pb2
from tests.conftest import collect, until
from tests.harness.link_proxy import LinkProxy
from tests.test_metrics import value
from tests.test_scheduler import plane, wait_for_chains  # noqa: F401 - plane is a fixture

CUT_S = 6.0  # several of the stages' 1 s leases


async def _load(stub, stop: asyncio.Event, outcomes: list[str]) -> None:
    """Greedy requests back to back until told to stop (bounded), each outcome recorded."""
    for _ in range(10_000):
        if stop.is_set():
            return
        try:
            ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=4),
                                                    timeout=30))
            outcomes.append("ok" if len(ids) == 4 else f"short: {ids}")
        except Exception as exc:  # the outcome is what this test counts
            outcomes.append(f"{type(exc).__name__}: {exc}")


async def test_stages_cut_off_from_the_registry_keep_their_chains_while_they_serve(plane):  # noqa: F811
    """Measured before the fix: the chain list went to 0 within a lease and every request in the cut failed."""
    scheduler = Scheduler(SchedulerConfig(model=str(plane.model), lock_ttl_s=1.0), open_registry(plane.url))
    plane.schedulers.append((scheduler, asyncio.get_running_loop().create_task(scheduler.run())))
    with LinkProxy(plane.registry_server.address) as link:
        for _ in range(2):
            await plane.add_stage(share_of_model=1.5, registry_url=f"local://{link.address}")
        stub = await plane.add_router()
        assert len(await wait_for_chains(stub, lambda c: len(c) == 2)) == 2
        stop, outcomes = asyncio.Event(), []
        load = asyncio.ensure_future(_load(stub, stop, outcomes))
        await asyncio.sleep(0.5)
        link.set(black_hole=True)  # only the stages' path: scheduler and router reach the registry directly
        fewest = 2
        for _ in range(int(CUT_S / 0.2)):
            await asyncio.sleep(0.2)
            fewest = min(fewest, len(await wait_for_chains(stub, lambda c: True, timeout=0)))
        link.set()
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(load, 60)
    assert fewest == 2, "a chain was withdrawn while its stages served"
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]


def _healthy(chains) -> list[str]:
    return sorted(c.chain_id for c in chains)


async def test_router_keeps_chains_that_pass_its_checks_when_a_table_drops_most_of_them(plane):  # noqa: F811
    """A table that would take away most of the chains serving now (a scheduler that lost sight of their
    stages) is not followed for those that still pass the router's own checks; a table that drops only some is."""
    await plane.add_scheduler()
    servers = [await plane.add_stage(share_of_model=1.5) for _ in range(2)]
    stub = await plane.add_router()
    both = _healthy(await wait_for_chains(stub, lambda c: len(c) == 2))
    assert len(both) == 2
    plane.schedulers[0][1].cancel()  # nobody re-publishes what this test writes
    with contextlib.suppress(asyncio.CancelledError):
        await plane.schedulers[0][1]
    registry = open_registry(plane.url)
    panics = value("stagemesh_router_panic_tables_total")
    try:
        table, _ = await registry.kv_get(chains_key(plane.model.name))
        published = {c.chain_id: c for c in decode_chains(table)}
        assert sorted(published) == both
        by_id = {c.chain_id: c for c in plane.router.chains.chains}
        await registry.kv_put(chains_key(plane.model.name), encode_chains([], "every stage lapsed"))
        await until(lambda: value("stagemesh_router_panic_tables_total") == panics + 1, 10,
                    "the router to read the empty table")
        assert _healthy(await wait_for_chains(stub, lambda c: True, timeout=0)) == both
        ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=3),
                                                timeout=30))
        assert len(ids) == 3

        # Dropping one of two is a re-plan, not a panic: followed.
        await registry.kv_put(chains_key(plane.model.name), encode_chains([published[both[0]]], "one chain"))
        assert _healthy(await wait_for_chains(stub, lambda c: len(c) == 1, timeout=10)) == [both[0]]
        assert value("stagemesh_router_panic_tables_total") == panics + 1
        assert by_id[both[1]].withdrawn
    finally:
        await registry.close()
    assert servers


async def test_a_leader_past_its_renew_deadline_writes_nothing(plane):  # noqa: F811
    """A leader whose event loop stalled past two thirds of its lease (a pause, a long reconcile) may already have
    been replaced: it stops acting and writes no assignment; the same leader within its deadline writes it."""
    registry = open_registry(plane.url)
    scheduler = Scheduler(SchedulerConfig(model=str(plane.model), lock_ttl_s=1.0), open_registry(plane.url))
    try:
        assert await registry.acquire_lock(leader_key(plane.model.name), scheduler.holder_id, 30)
        await registry.register(ServiceRecord("joiner", "127.0.0.1:9", plane.model.name,
                                              {"budget_bytes": str(10**12), "speed": "1"}), ttl_s=30)
        services = await registry.services(plane.model.name)
        scheduler._renewed_at = asyncio.get_running_loop().time() - 10  # its last renewal: 10 leases ago
        with pytest.raises(LeaseLapsing):
            await scheduler.reconcile(services)
        assert await registry.kv_get(assignment_key(plane.model.name, "joiner")) == (None, 0)

        scheduler._renewed_at = asyncio.get_running_loop().time()  # renewed just now: it acts
        await scheduler.reconcile(services)
        assert (await registry.kv_get(assignment_key(plane.model.name, "joiner")))[0] == b"0:8"
    finally:
        await scheduler.stop()
        await scheduler.registry.close()
        await registry.close()


async def test_an_assignment_overwritten_behind_the_leaders_back_is_corrected(plane):  # noqa: F811
    """A write the leader did not make (an operator's mistake, a stale leader's before fencing) is put back to the
    plan: before, the leader trusted what it had written and never looked again."""
    await plane.add_scheduler()
    server = await plane.add_stage(share_of_model=1.5)
    registry = open_registry(plane.url)
    key = assignment_key(plane.model.name, plane.stages[0][1].service_id)
    try:
        await until(lambda: server.layers == (0, 8), 60, "the stage serving its assigned 0:8")
        await registry.kv_put(key, b"0:4")  # a range no plan contains
        for _ in range(300):  # bounded: 30 s
            value, _ = await registry.kv_get(key)
            if value == b"0:8":
                break
            await asyncio.sleep(0.1)
        assert value == b"0:8", value
        await until(lambda: server.layers == (0, 8), 60, "the stage serving its planned 0:8 again")
    finally:
        await registry.close()


def _loads(caplog) -> int:
    return sum(1 for r in caplog.records if r.name == "stagemesh.stage" and r.getMessage().startswith("loaded layers"))


def _start_scheduler(plane) -> Scheduler:  # noqa: F811
    scheduler = Scheduler(SchedulerConfig(model=str(plane.model), lock_ttl_s=1.0, settle_s=1.0, rejoin_s=30.0),
                          open_registry(plane.url))
    plane.schedulers.append((scheduler, asyncio.get_running_loop().create_task(scheduler.run())))
    return scheduler


@pytest.mark.parametrize("with_scheduler", [False, True], ids=["registry-alone", "scheduler-hosting-it"])
async def test_a_registry_restarted_empty_under_load_reloads_no_stage(plane, caplog, with_scheduler):  # noqa: F811
    """The registry comes back empty while every stage serves (alone, or with the scheduler that hosts it: a new
    scheduler that knows nothing); one stage's path to it stays silent for longer than the new leader's settling:
    no stage loads another range (the spare stays spare), no assignment moves, no request fails. Before, a new
    scheduler planned the silent stage as missing and re-split its chain with the spare."""
    caplog.set_level(logging.INFO, logger="stagemesh.stage")  # its "loaded layers" lines are counted
    _start_scheduler(plane)
    with LinkProxy(plane.registry_server.address) as link:
        for i in range(4):  # two chains of two (the silent stage in one of them) ...
            await plane.add_stage(share_of_model=0.6, registry_url=f"local://{link.address}" if i == 0 else "")
        stub = await plane.add_router()
        assert len(await wait_for_chains(stub, lambda c: len(c) == 2)) == 2
        spare = await plane.add_stage(share_of_model=0.6)  # ... and a spare
        spare_id = plane.stages[-1][1].service_id
        registry = open_registry(plane.url)
        for _ in range(300):  # bounded: 30 s
            if (await registry.kv_get(assignment_key(plane.model.name, spare_id)))[1]:
                break
            await asyncio.sleep(0.1)
        assert spare.layers is None
        before = {e.key: e.value for e in await registry.kv_list(assignments_prefix(plane.model.name))}
        loads = _loads(caplog)
        stop, outcomes = asyncio.Event(), []
        load = asyncio.ensure_future(_load(stub, stop, outcomes))
        try:
            await asyncio.sleep(0.5)
            link.set(black_hole=True)  # the first stage's path to the registry, through the restart and after
            port = plane.registry_server.port
            if with_scheduler:  # it dies with its registry, without releasing anything
                plane.schedulers[0][1].cancel()
            await plane.registry_server.stop(0)
            plane.registry_server = await start_registry_server(port=port)
            if with_scheduler:
                _start_scheduler(plane)
            await asyncio.sleep(CUT_S)  # the silent stage's registration is still missing all this time
            link.set()
            for _ in range(300):  # bounded: 30 s for the silent stage to register and its assignment to be rewritten
                after = {e.key: e.value for e in await registry.kv_list(assignments_prefix(plane.model.name))}
                if {k: v for k, v in after.items() if v} == {k: v for k, v in before.items() if v}:
                    break
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.wait_for(load, 60)
            await registry.close()
    assert _loads(caplog) == loads, "a stage loaded another range"
    assert {k: v for k, v in after.items() if v} == {k: v for k, v in before.items() if v}
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]
