"""OpenTelemetry tracing, off unless a process is given `--otlp-endpoint`: one span per gRPC call on
each side of every hop (caller -> router -> each stage), joined into one trace by the `traceparent`
metadata that OpenTelemetry's own gRPC instrumentation carries. It instruments grpc.aio globally, so
call it before any server or channel is made. OpenTelemetry is the `otel` extra (pip install 'stagemesh[otel]');
without it tracing stays off and --otlp-endpoint is refused by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

try:  # an optional dependency (the otel extra)
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer, filters
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

    OTEL = True
except ImportError:
    OTEL = False

_instruments: list = []
_provider: TracerProvider | None = None


@dataclass
class TracingConfig:
    otlp_endpoint: str | None = None
    """Send OpenTelemetry traces (a span per gRPC call on each side of every hop) to this OTLP/gRPC
    collector, HOST:PORT (default: no tracing)."""


def setup_tracing(service: str, endpoint: str | None, exporter: SpanExporter | None = None) -> bool:
    """Traces this process's gRPC calls to the OTLP collector at endpoint (host:port, plaintext gRPC),
    or to `exporter` (tests). Nothing happens without either. True if tracing is on."""
    if not endpoint and exporter is None:
        return False
    if not OTEL:
        raise ValueError("--otlp-endpoint needs OpenTelemetry, which is not installed: pip install 'stagemesh[otel]'")
    global _provider
    provider = _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    # Health calls are not traced: probes every few seconds would bury the requests' traces, and
    # OpenTelemetry's server wrapper iterates every response stream, which grpc's Health/Watch (a
    # coroutine that writes) is not: traced, every Watch failed UNKNOWN.
    untraced_health = filters.negate(filters.health_check())
    for instrumentor in (GrpcAioInstrumentorServer(filter_=untraced_health),
                         GrpcAioInstrumentorClient(filter_=untraced_health)):
        instrumentor.instrument(tracer_provider=provider)
        _instruments.append(instrumentor)
    return True


def stop_tracing() -> None:
    """Undoes setup_tracing's instrumentation (for tests; a process just exits)."""
    global _provider
    _provider = None
    while _instruments:
        _instruments.pop().uninstrument()


def client_span(name: str, carrier: dict) -> trace.Span | None:
    """A span of a call made without a gRPC call of its own (one that rides a shared stream), child of the
    current one; its context is written into carrier for the other side. None when tracing is off."""
    if _provider is None:
        return None
    span = _provider.get_tracer("stagemesh").start_span(name, kind=trace.SpanKind.CLIENT)
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span


def server_span(name: str, carrier: dict) -> trace.Span | None:
    """The serving side of client_span: a span whose parent is the one written into carrier."""
    if _provider is None or not carrier:
        return None
    parent = propagate.extract(dict(carrier), context=otel_context.Context())
    return _provider.get_tracer("stagemesh").start_span(name, context=parent, kind=trace.SpanKind.SERVER)


def http_server_span(name: str, headers: Mapping[str, str]) -> trace.Span | None:
    """A span of a call to the router's HTTP front ("POST /v1/completions"), child of the caller's `traceparent`
    header when it sent one, else a trace's root. None when tracing is off. The caller ends it (span.end())."""
    if _provider is None:
        return None
    parent = propagate.extract({k: v for k, v in headers.items()}, context=otel_context.Context())
    return _provider.get_tracer("stagemesh").start_span(name, context=parent, kind=trace.SpanKind.SERVER)


@contextlib.contextmanager
def current(span: trace.Span | None) -> Iterator[None]:
    """Makes span the current one inside the block (the calls made there are its children); nothing for None."""
    if span is None:
        yield
        return
    with trace.use_span(span, end_on_exit=False):
        yield
