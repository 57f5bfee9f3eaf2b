"""The router's Prometheus metrics count what happened."""

from __future__ import annotations

import asyncio
import logging
import urllib.request

from prometheus_client import REGISTRY

from stagemesh import metrics
from stagemesh.v1 import router_pb2
from tests.conftest import collect, splits, start_mesh


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_router_metrics_count_tokens_requests_and_refusals(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        tokens, ok = value("stagemesh_router_tokens_total"), value("stagemesh_router_requests_total", status="OK")
        turnarounds = value("stagemesh_router_token_turnaround_seconds_count")
        ids, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6],
                                                                                       max_new_tokens=7)))
        assert value("stagemesh_router_tokens_total") - tokens == len(ids)
        # one turnaround between each token and the next step; none after the last token
        assert value("stagemesh_router_token_turnaround_seconds_count") - turnarounds == len(ids) - 1
        assert value("stagemesh_router_requests_total", status="OK") - ok == 1
        assert value("stagemesh_router_time_to_first_token_seconds_count", priority_class="normal") >= 1
        assert value("stagemesh_router_usable_chains") == 1
    finally:
        await mesh.stop()


def test_metrics_are_served_over_http(unused_tcp_port):
    metrics.serve_metrics(unused_tcp_port)
    with urllib.request.urlopen(f"http://127.0.0.1:{unused_tcp_port}/metrics", timeout=5) as response:
        assert b"stagemesh_router_requests_total" in response.read()


async def test_stage_metrics_count_passes_tokens_bytes_and_pool_use(tiny_model):
    before = {name: value(name) for name in ("stagemesh_stage_pass_tokens_count", "stagemesh_stage_pass_tokens_sum")}
    wire_in, wire_out = value("stagemesh_stage_wire_bytes_total", direction="in"), value(
        "stagemesh_stage_wire_bytes_total", direction="out")
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=40)))
        # 2 stages: the prompt's pass and 39 decode passes at each
        assert value("stagemesh_stage_pass_tokens_count") - before["stagemesh_stage_pass_tokens_count"] >= 2 * 40
        assert value("stagemesh_stage_pass_seconds_count", batch="1") >= 2 * 40
        assert value("stagemesh_stage_wire_bytes_total", direction="in") > wire_in
        assert value("stagemesh_stage_wire_bytes_total", direction="out") > wire_out
        long = mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=2000))
        assert (await long.read()).token_ids
        for _ in range(300):  # the gauges are refreshed every second: up to 30 s for a slow machine's refresh
            if value("stagemesh_stage_open_sessions") == 1 and value("stagemesh_stage_kv_used_bytes") > 0:
                break
            await asyncio.sleep(0.1)
        assert value("stagemesh_stage_open_sessions") == 1  # the one stream's session (at either stage)
        assert value("stagemesh_stage_kv_used_bytes") > 0 and value("stagemesh_stage_kv_free_bytes") > 0
        long.cancel()
    finally:
        await mesh.stop()


async def test_a_callers_request_id_is_in_the_log_lines_of_the_router_and_of_every_stage(tiny_model, caplog):
    mesh = await start_mesh(tiny_model, [splits(2, 3, 3)])
    try:
        with caplog.at_level(logging.INFO):
            await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(
                token_ids=[5, 6, 7], max_new_tokens=3, request_id="follow-me-42"), timeout=30))
            await asyncio.sleep(0.2)  # the stages log their sessions' end as the streams close
        tagged = [r for r in caplog.records if getattr(r, "request_id", None) == "follow-me-42"]
        assert any(r.name == "stagemesh.router" for r in tagged)
        stages = {getattr(r, "stage", "") for r in tagged if r.name == "stagemesh.stage"}
        assert stages == {s.address for s in mesh.all_stages()}
        opened_and_closed = [r.getMessage() for r in tagged if r.name == "stagemesh.stage"]
        assert opened_and_closed.count("session opened") == 3
        # Closed by the router's close on its Sessions stream (or by that stream's end).
        assert sum(m.startswith("session closed") for m in opened_and_closed) == 3
    finally:
        await mesh.stop()
