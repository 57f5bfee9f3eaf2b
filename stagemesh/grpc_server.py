"""What every stagemesh server has: grpc.health.v1, server reflection, and a bound loopback port."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

# Hidden states of a long prefill can be large; the default 4 MiB limit would reject them.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A server with stagemesh's message limits; its services' servers pass their
    errors.StatusInterceptor here, so that every handler's errors are answered one way."""
    return grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=list(interceptors))


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


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Binds host:port (port 0 picks a free one) and returns the port bound."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}: is the port in use?")
    return bound


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
