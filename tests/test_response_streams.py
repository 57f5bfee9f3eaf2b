"""Response streams on every stagemesh server, with tracing on and off. A handler cleans up when its call
ends, however it ends: the router gives back a caller's admission slot and a stage closes a stream's
sessions in their handlers' `finally`. grpc.aio iterates a handler's generator and never closes it: a
caller that cancels while the server waits in a write leaves the outermost wrapper suspended, which asyncio
closes as soon as grpc lets go of it, and each wrapper closes the generator it wraps (errors.
StatusInterceptor's, router/auth's, the router's Generate). And grpc's own Health/Watch, a coroutine that
writes, answers. Real servers on loopback."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagemesh import grpc_server
from stagemesh.errors import StatusInterceptor
from stagemesh.tracing import setup_tracing, stop_tracing

CHUNK = b"x" * (1 << 20)  # one message fills the caller's flow-control window: the server waits in its write


@pytest.fixture(params=[False, True], ids=["untraced", "traced"])
def traced(request) -> InMemorySpanExporter | None:
    """Tracing on (its spans) or off (None)."""
    spans = InMemorySpanExporter() if request.param else None
    if spans:
        assert setup_tracing("stagemesh-test", None, spans)
    yield spans
    stop_tracing()


@pytest.fixture
def no_gc():
    """The collector off: what a handler leaves to it never happens."""
    gc.disable()
    yield
    gc.enable()


async def flood_server(closed: asyncio.Event, writing: asyncio.Event | None = None) -> tuple[grpc.aio.Server, str]:
    """A server whose handler writes CHUNK after CHUNK; `closed` is set when its finally runs, `writing` when it has
    handed grpc its second message, which waits for room in the caller's window."""
    async def flood(request: bytes, context: grpc.aio.ServicerContext):
        try:
            for sent in itertools.count():
                if sent == 1 and writing is not None:
                    writing.set()
                yield CHUNK
        finally:
            closed.set()

    server = grpc_server.new_server([StatusInterceptor(logging.getLogger("test"))])
    handlers = {"Flood": grpc.unary_stream_rpc_method_handler(flood)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Flood", handlers),))
    health = grpc_server.add_health_and_reflection(server, ["test.Flood"])
    port = grpc_server.bind(server, "127.0.0.1", 0)
    await server.start()
    await grpc_server.set_serving(health, ["test.Flood"], True)
    return server, f"127.0.0.1:{port}"


async def test_a_caller_that_cancels_mid_write_ends_the_handler_at_once(traced, no_gc):
    closed, writing = asyncio.Event(), asyncio.Event()
    server, address = await flood_server(closed, writing)
    try:
        async with grpc_server.insecure_channel(address) as channel:
            for _ in range(5):
                closed.clear()
                writing.clear()
                call = channel.unary_stream("/test.Flood/Flood")(b"", timeout=30)
                assert await call.read() == CHUNK
                await asyncio.wait_for(writing.wait(), timeout=30)  # the server waits in its next write
                call.cancel()
                await asyncio.wait_for(closed.wait(), timeout=30)  # the handler's finally ran
    finally:
        await server.stop(0)


async def test_a_health_watch_answers_with_tracing_on_or_off_and_probes_make_no_spans(traced):
    server, address = await flood_server(asyncio.Event())
    try:
        async with grpc_server.insecure_channel(address) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="test.Flood"),
                                                            timeout=30)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            call.cancel()
            check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    if traced:
        assert not [s.name for s in traced.get_finished_spans() if "Health" in s.name]
