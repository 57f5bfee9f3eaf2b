"""With tracing on, one request is one trace: a span per gRPC call (or open on a shared stream) on each side
of every hop."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagemesh.tracing import setup_tracing, stop_tracing
from stagemesh.v1 import router_pb2
from tests.conftest import collect, splits, start_mesh


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert setup_tracing("stagemesh-test", None, exporter)
    yield exporter
    stop_tracing()


async def test_a_request_is_one_trace_across_the_router_and_every_stage(tiny_model, spans):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        spans.clear()
        await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=3),
                                                timeout=30))
    finally:
        await mesh.stop()
    finished = spans.get_finished_spans()
    caller = [s for s in finished if s.name.endswith("Router/Generate") and s.parent is None]
    assert len(caller) == 1, [s.name for s in finished]
    in_trace = [s for s in finished if s.context.trace_id == caller[0].context.trace_id]
    kinds = {(s.name.rsplit("/", 1)[1], s.kind.name) for s in in_trace}
    # The caller's call as the router served it, and the router's opens on both stages as the router
    # made them and as each stage served them. (They and the steps ride the router's long-lived Sessions
    # stream to each stage, shared by every request: the opens carry the trace context themselves.)
    wanted = {("Generate", "SERVER"), ("OpenSession", "CLIENT"), ("OpenSession", "SERVER")}
    assert wanted <= kinds
    assert sum(s.name.endswith("Stage/OpenSession") and s.kind.name == "SERVER" for s in in_trace) == 2
    assert sum(s.name.endswith("Stage/OpenSession") and s.kind.name == "CLIENT" for s in in_trace) == 2


def test_tracing_is_off_without_an_endpoint():
    assert not setup_tracing("stagemesh-test", None)
