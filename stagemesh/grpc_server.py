"""What every stagemesh server has: grpc.health.v1, server reflection, a bound port (plaintext or TLS),
and the channels between components."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from stagemesh.tls import Tls

# Hidden states of a long prefill can be large; the default 4 MiB limit would reject them.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
PUBLIC_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""What the router's public port accepts in one message: a request whose prompt is as long as any
context we serve fits many times over; a 256 MiB message from anyone does not."""
BUSY_STREAM_WAIT_S = 0.002
"""A stream carrying many sessions (Stage/Sessions, both ways) whose last message went under this long ago
waits this long before the next, so that one message carries many sessions' traffic: a gRPC write costs
about as much for one step as for a hundred (busy_wait_s)."""


def busy_wait_s(sessions: int, since_write_s: float) -> float:
    """How long a stream multiplexing `sessions` holds its next message, its last one written since_write_s ago:
    BUSY_STREAM_WAIT_S while it is busy with several sessions, else nothing. An idle stream, or one carrying a
    lone session, writes at once: a lone stream whose tokens come faster than BUSY_STREAM_WAIT_S (a small model,
    a GPU) would otherwise wait that long at every hop of every token."""
    return BUSY_STREAM_WAIT_S if sessions > 1 and since_write_s < BUSY_STREAM_WAIT_S else 0.0


KEEPALIVE_S = 30.0
"""Channels ping an idle peer this often, and a peer that does not answer in KEEPALIVE_TIMEOUT_S is
dropped: a host that black-holes packets, or a stopped process, fails its calls instead of hanging.
Generous on purpose: the router's per-step progress timeout catches a hung stage mid-stream much
sooner; keepalive is for the connections nobody is waiting on, and must not drop a peer whose
event loop was merely busy for a few seconds."""
KEEPALIVE_TIMEOUT_S = 20.0
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # An unreachable peer is tried again every second, however long it has been down. gRPC's default
    # backoff grows to 120 s: a stage that came back after an outage would sit unused (its chain
    # failing the router's health checks) for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept our clients' keepalive pings (by default a server answers frequent pings with GOAWAY).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000) // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               max_receive_bytes: int = MAX_MESSAGE_BYTES,
               options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Server:
    """A server with stagemesh's message limits and keepalive; its services' servers pass their
    errors.StatusInterceptor here, so that every handler's errors are answered one way. options: gRPC channel
    arguments that replace stagemesh's of the same name (the router's public port's limits)."""
    given = {"grpc.max_receive_message_length": max_receive_bytes, **dict(options)}
    merged = [o for o in SERVER_OPTIONS if o[0] not in given] + list(given.items())
    return grpc.aio.server(options=merged, interceptors=list(interceptors))


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Registers health (starting NOT_SERVING) and reflection for service_names."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(_Reflection(names), server)
    return servicer


class _Reflection(reflection_aio.ReflectionServicer):
    """Also finds the file of a method symbol (`grpcurl describe stagemesh.v1.Router.Generate`):
    protobuf's upb pool indexes services but not their methods."""

    def _file_containing_symbol(self, request, fully_qualified_name):
        try:
            self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            parent = fully_qualified_name.rpartition(".")[0]
            if parent:
                return super()._file_containing_symbol(request, parent)
        return super()._file_containing_symbol(request, fully_qualified_name)


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    """Sets both the overall ("") and the per-service status, as grpc health probes read either."""
    status = (
        health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *service_names]:
        await servicer.set(name, status)


def host_port(host: str, port: int) -> str:
    """"host:port", with an IPv6 address in brackets ("[::1]:50061")."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    """0.0.0.0, :: and the like: an address to listen on, never one to reach a server at."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds host:port (port 0 picks a free one), with TLS when credentials are given (stagemesh.tls),
    and returns the port bound."""
    address = host_port(host, port)
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host_port(host, port)}: is the port in use?")
    return bound


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def channel(address: str, tls: Tls | None = None) -> grpc.aio.Channel:
    """A channel to another component: mutual TLS against the mesh CA with tls, plaintext without."""
    if tls is None:
        return insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)
