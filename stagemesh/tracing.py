"""OpenTelemetry tracing, off unless a process is given `--otlp-endpoint`: one span per gRPC call on
each side of every hop (caller -> router -> each stage), joined into one trace by the `traceparent`
metadata that OpenTelemetry's own gRPC instrumentation carries. It instruments grpc.aio globally, so
call it before any server or channel is made."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

_instruments: list = []


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
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    for instrumentor in (GrpcAioInstrumentorServer(), GrpcAioInstrumentorClient()):
        instrumentor.instrument(tracer_provider=provider)
        _instruments.append(instrumentor)
    return True


def stop_tracing() -> None:
    """Undoes setup_tracing's instrumentation (for tests; a process just exits)."""
    while _instruments:
        _instruments.pop().uninstrument()
