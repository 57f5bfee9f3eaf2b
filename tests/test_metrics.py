"""The router's Prometheus metrics count what happened."""

from __future__ import annotations

import asyncio
import logging
import urllib.request

from prometheus_client import REGISTRY

from stagemesh import metrics
from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.registry import ServiceRecord
from stagemesh.registry.state import EmbeddedRegistry
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.scheduler.scheduler import Scheduler, SchedulerConfig
from stagemesh.v1 import router_pb2
from tests.conftest import collect, splits, start_mesh, until
from tests.test_scheduler import ControlPlane


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_router_metrics_count_tokens_requests_and_refusals(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        tokens, ok = value("stagemesh_router_tokens_total"), value("stagemesh_router_requests_total", status="OK")
        turnarounds = value("stagemesh_router_token_turnaround_seconds_count")
        firsts = value("stagemesh_router_time_to_first_token_seconds_count", priority_class="normal")
        ids, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6],
                                                                                       max_new_tokens=7)))
        assert value("stagemesh_router_tokens_total") - tokens == len(ids)
        # one turnaround between each token and the next step; none after the last token
        assert value("stagemesh_router_token_turnaround_seconds_count") - turnarounds == len(ids) - 1
        assert value("stagemesh_router_requests_total", status="OK") - ok == 1
        assert value("stagemesh_router_time_to_first_token_seconds_count", priority_class="normal") - firsts == 1
        assert value("stagemesh_router_usable_chains") == 1
    finally:
        await mesh.stop()


def test_metrics_are_served_over_http(unused_tcp_port):
    metrics.serve_metrics(unused_tcp_port)
    with urllib.request.urlopen(f"http://127.0.0.1:{unused_tcp_port}/metrics", timeout=5) as response:
        assert b"stagemesh_router_requests_total" in response.read()


async def test_stage_metrics_count_passes_tokens_bytes_and_pool_use(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        names = ("stagemesh_stage_pass_tokens_count", "stagemesh_stage_pass_tokens_sum")
        before = {name: value(name) for name in names}
        lone_passes = value("stagemesh_stage_pass_seconds_count", batch="1")
        wire_in, wire_out = (value("stagemesh_stage_wire_bytes_total", direction=d) for d in ("in", "out"))
        await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=40)))
        # 2 stages: the prompt's pass (3 tokens) and 39 decode passes (1 token) at each, every one a pass of 1 step
        assert value("stagemesh_stage_pass_tokens_count") - before["stagemesh_stage_pass_tokens_count"] == 2 * 40
        assert value("stagemesh_stage_pass_tokens_sum") - before["stagemesh_stage_pass_tokens_sum"] == 2 * (3 + 39)
        assert value("stagemesh_stage_pass_seconds_count", batch="1") - lone_passes == 2 * 40
        assert value("stagemesh_stage_wire_bytes_total", direction="in") > wire_in
        assert value("stagemesh_stage_wire_bytes_total", direction="out") > wire_out
        # A session at each stage, stepped once and held until closed here (a stream through the router could end
        # before the gauges' next refresh, every second): the gauges show it once a refresh has run, after one
        # showed the stream's sessions gone.
        assert [i.open_sessions for i in await mesh.settled_infos()] == [0, 0]
        await until(lambda: value("stagemesh_stage_open_sessions") == 0, 30, "the gauges show no session")
        chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
        async with ChainSession(chain, 64, "held") as session:
            await session.step([5, 6, 7], sampling=Sampling())
            await until(lambda: value("stagemesh_stage_open_sessions") == 1
                        and value("stagemesh_stage_kv_used_bytes") > 0,
                        30, "the gauges show each stage's one session and its cache")
            assert value("stagemesh_stage_kv_free_bytes") > 0
        for stage in chain.stages:
            await stage.close()
    finally:
        await mesh.stop()


async def test_a_callers_request_id_is_in_the_log_lines_of_the_router_and_of_every_stage(tiny_model, caplog):
    mesh = await start_mesh(tiny_model, [splits(2, 3, 3)])

    def tagged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "request_id", None) == "follow-me-42"]

    def stage_lines() -> list[str]:
        return [r.getMessage() for r in tagged() if r.name == "stagemesh.stage"]

    try:
        with caplog.at_level(logging.INFO):
            await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(
                token_ids=[5, 6, 7], max_new_tokens=3, request_id="follow-me-42"), timeout=30))
            # The stages log their sessions' end as the streams close, a moment after the caller's stream ended.
            await until(lambda: sum(m.startswith("session closed") for m in stage_lines()) >= 3, 30,
                        "the three stages logged their sessions' close")
        assert any(r.name == "stagemesh.router" for r in tagged())
        stages = {getattr(r, "stage", "") for r in tagged() if r.name == "stagemesh.stage"}
        assert stages == {s.address for s in mesh.all_stages()}
        assert stage_lines().count("session opened") == 3
        # Closed by the router's close on its Sessions stream (or by that stream's end).
        assert sum(m.startswith("session closed") for m in stage_lines()) == 3
    finally:
        await mesh.stop()


async def test_router_metrics_time_every_token_and_the_whole_request(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        names = ("stagemesh_router_inter_token_seconds_count", "stagemesh_router_inter_token_seconds_sum",
                 "stagemesh_router_request_seconds_count", "stagemesh_router_request_seconds_sum")
        before = {name: value(name, priority_class="normal") for name in names}
        prompt_tokens = value("stagemesh_router_prompt_tokens_total")
        ids, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7],
                                                                                       max_new_tokens=9)))
        after = {name: value(name, priority_class="normal") for name in names}
        # one gap per token after the first; one request, at least as long as its gaps together
        assert after["stagemesh_router_inter_token_seconds_count"] - \
            before["stagemesh_router_inter_token_seconds_count"] == len(ids) - 1
        assert after["stagemesh_router_request_seconds_count"] - before["stagemesh_router_request_seconds_count"] == 1
        assert after["stagemesh_router_request_seconds_sum"] - before["stagemesh_router_request_seconds_sum"] >= \
            after["stagemesh_router_inter_token_seconds_sum"] - before["stagemesh_router_inter_token_seconds_sum"]
        assert value("stagemesh_router_prompt_tokens_total") - prompt_tokens == 3
        # each process says what it runs, for which model, at which version
        for component in ("router", "stage"):
            assert value("stagemesh_build_info", component=component, model=tiny_model.name,
                         version=metrics.version()) == 1
    finally:
        await mesh.stop()


def test_tokens_that_leave_together_count_their_gap_once():
    count = "stagemesh_router_inter_token_seconds_count"
    total = "stagemesh_router_inter_token_seconds_sum"
    before = value(count, priority_class="batch"), value(total, priority_class="batch")
    metrics.observe_inter_token(None, 3, "batch")  # a request's first 3 tokens: 2 gaps of 0 after the first
    metrics.observe_inter_token(0.5, 2, "batch")  # 2 more, 0.5 s later: 0.5, then 0
    metrics.observe_inter_token(0.25, 0, "batch")  # a piece without tokens: nothing
    assert value(count, priority_class="batch") - before[0] == 4
    assert value(total, priority_class="batch") - before[1] == 0.5


async def test_registry_metrics_count_services_keys_waiting_watches_and_expired_leases():
    registry = EmbeddedRegistry()
    try:
        expired = {kind: value("stagemesh_registry_lease_expiries_total", kind=kind)
                   for kind in ("service", "deregistered", "lock")}
        await registry.register(ServiceRecord("stage-a", "127.0.0.1:1", "m"), ttl_s=0.2, deregister_after_s=0.2)
        assert value("stagemesh_registry_services", state="passing") == 1
        await registry.kv_put("stagemesh/m/chains", b"[]")
        assert value("stagemesh_registry_kv_keys") == 1
        _, index = await registry.kv_get("stagemesh/m/chains")
        watch = asyncio.get_running_loop().create_task(registry.watch_key("stagemesh/m/chains", index, timeout_s=30))
        await until(lambda: value("stagemesh_registry_watch_waiters") == 1, 10, "the watch waits")
        await registry.kv_put("stagemesh/m/chains", b"[1]")
        await asyncio.wait_for(watch, 10)
        assert value("stagemesh_registry_watch_waiters") == 0
        assert await registry.acquire_lock("stagemesh/m/leader", "scheduler-a-secret-0001", ttl_s=0.2)
        assert value("stagemesh_registry_kv_keys") == 2
        # no heartbeat, no renewal: the stage turns critical and is removed, the lock is freed
        await until(lambda: value("stagemesh_registry_lease_expiries_total", kind="deregistered")
                    > expired["deregistered"] and value("stagemesh_registry_lease_expiries_total", kind="lock")
                    > expired["lock"], 10, "the leases ran out")
        assert value("stagemesh_registry_lease_expiries_total", kind="service") - expired["service"] == 1
        assert value("stagemesh_registry_services", state="passing") == 0
        assert value("stagemesh_registry_services", state="critical") == 0
        assert value("stagemesh_registry_kv_keys") == 1
    finally:
        await registry.close()


async def test_scheduler_metrics_say_who_leads_what_it_saw_and_what_it_published(tiny_model):
    plane = await ControlPlane(tiny_model).start()
    try:
        takeovers = value("stagemesh_scheduler_leadership_acquired_total")
        reconciles = value("stagemesh_scheduler_reconcile_seconds_count")
        writes = value("stagemesh_scheduler_chain_table_writes_total", outcome="ok")
        # A lease long enough that a stalled event loop (4 test files on 2 cores) does not lose and take the lock again
        # mid-test: one takeover is the count checked.
        scheduler = Scheduler(SchedulerConfig(model=str(tiny_model), lock_ttl_s=10.0, settle_s=0.0),
                              open_registry(plane.url))
        task = asyncio.get_running_loop().create_task(scheduler.run())
        await plane.add_stage(share_of_model=1.5)
        await plane.add_stage(share_of_model=1.5)
        await until(lambda: value("stagemesh_scheduler_chains_published") == 2, 60, "two replicas published")
        assert value("stagemesh_scheduler_is_leader") == 1
        assert value("stagemesh_scheduler_leadership_acquired_total") - takeovers == 1
        assert value("stagemesh_scheduler_stages", state="passing") == 2
        assert value("stagemesh_scheduler_stages", state="assigned") == 2
        assert value("stagemesh_scheduler_reconcile_seconds_count") > reconciles
        assert value("stagemesh_scheduler_chain_table_writes_total", outcome="ok") > writes
        assert value("stagemesh_build_info", component="scheduler", model=tiny_model.name,
                     version=metrics.version()) == 1
        # standing down: it leads no more and publishes nothing
        await plane.stop_registry()
        await until(lambda: value("stagemesh_scheduler_is_leader") == 0, 30, "the scheduler stood down")
        assert value("stagemesh_scheduler_chains_published") == 0
        task.cancel()
    finally:
        for server, registration in plane.stages:
            await plane.stop_registration(registration)
            await server.stop(0)
        await plane.registry_server.stop(0)
