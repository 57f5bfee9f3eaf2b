"""The router's Prometheus metrics count what happened."""

from __future__ import annotations

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
