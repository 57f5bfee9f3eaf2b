"""The router's Prometheus metrics count what happened."""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client import REGISTRY

from stagemesh import metrics, wire
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import collect, splits, start_mesh, until


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
        stubs = [mesh.stage_stub(0, i) for i in range(2)]
        for stub in stubs:
            await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="held", max_length=64))
        steps = [stub.Forward() for stub in stubs]
        await steps[0].write(stage_pb2.ForwardRequest(session_id="held", start=0, token_ids=wire.encode_ids([5, 6, 7])))
        hidden = (await steps[0].read()).hidden
        await steps[1].write(stage_pb2.ForwardRequest(session_id="held", start=0, hidden=hidden))
        assert (await steps[1].read()).session_id == "held"
        await until(lambda: value("stagemesh_stage_open_sessions") == 1 and value("stagemesh_stage_kv_used_bytes") > 0,
                    30, "the gauges show each stage's one session and its cache")
        assert value("stagemesh_stage_kv_free_bytes") > 0
        for call in steps:
            call.cancel()
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
