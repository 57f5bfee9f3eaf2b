"""The stagemesh.v1.Registry gRPC service over an EmbeddedRegistry, on its own server (`stagemesh registry`)
or hosted next to the scheduler."""

from __future__ import annotations

import logging

import grpc

from stagemesh import grpc_server, metrics, roles
from stagemesh.discovery import embedded as er
from stagemesh.discovery.registry import MAX_VALUE_BYTES, LockHeld, LockLost, holder_name, split_address
from stagemesh.errors import ErrorCodes, StatusInterceptor
from stagemesh.registry.state import EmbeddedRegistry
from stagemesh.signals import on_reload, until_signalled
from stagemesh.tls import Tls
from stagemesh.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger("stagemesh.registry")
SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
MAX_REQUEST_BYTES = MAX_VALUE_BYTES + 64 * 1024
"""The largest request the registry accepts: a KV value at its limit, its key and framing (records are
smaller); gRPC refuses a larger one before buffering it."""


ERROR_CODES: ErrorCodes = {ValueError: grpc.StatusCode.INVALID_ARGUMENT, LockHeld: grpc.StatusCode.FAILED_PRECONDITION,
                           LockLost: grpc.StatusCode.FAILED_PRECONDITION}
"""A ValueError from the registry (a bad key, record or ttl) is the caller's fault: INVALID_ARGUMENT; a write or
delete of a held lock's key, or a fenced one whose holder lost its lock, FAILED_PRECONDITION.
The server hosting the service answers with these through its StatusInterceptor."""


ROLE_POLICY = roles.ServicePolicy(SERVICE_NAME, "scheduler", {
    **dict.fromkeys(("Register", "Heartbeat", "Deregister"), "stage"),
    **dict.fromkeys(("ListServices", "WatchServices", "KvGet", "KvList", "WatchKey", "WatchPrefix", "LockHolder"))})
"""With TLS: every write (the chain table, assignments, the leader lock; any write added later) is a scheduler's,
stage records are stages' (and only at the hosts their certificate names: _check_stage_host); reads take any mesh
certificate."""


class RegistryService(registry_pb2_grpc.RegistryServicer):
    """Thin: every RPC is one EmbeddedRegistry call; watches wait here, on the server."""

    def __init__(self, registry: EmbeddedRegistry):
        self.registry = registry

    async def _check_stage_host(self, context, service_id: str, address: str = "") -> None:
        """PERMISSION_DENIED unless the stage certificate calling names the host of the record's address and of the
        record it would replace: one stage cannot take over, renew or remove another host's registration."""
        peer = roles.peer_of(context)
        if peer is None or peer.role_less:
            return
        known = [s.record.address for s in await self.registry.services(None)
                 if s.record.service_id == service_id]
        for where in filter(None, (address, *known)):
            host = split_address(where)[0]
            if not roles.names_host(peer, host):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"stage {service_id} at {where}: the caller's certificate names the hosts "
                                    f"{', '.join(peer.hosts) or '(none)'}, not {host}")

    async def Register(self, request, context):
        await self._check_stage_host(context, request.record.service_id, request.record.address)
        await self.registry.register(er.record_from_pb(request.record), request.ttl_s,
                                     request.deregister_after_s or None)
        return registry_pb2.RegisterResponse()

    async def Heartbeat(self, request, context):
        await self._check_stage_host(context, request.service_id)
        return registry_pb2.HeartbeatResponse(known=await self.registry.heartbeat(request.service_id))

    async def Deregister(self, request, context):
        await self._check_stage_host(context, request.service_id)
        await self.registry.deregister(request.service_id)
        return registry_pb2.DeregisterResponse()

    async def ListServices(self, request, context):
        return er.statuses_to_pb(*await self.registry.watch_services(0, 0, request.model or None))

    async def WatchServices(self, request, context):
        return er.statuses_to_pb(*await self.registry.watch_services(request.index, request.timeout_s,
                                                                     request.model or None))

    async def KvGet(self, request, context):
        return self._get_response(*await self.registry.watch_key(request.key, 0, 0))

    async def KvPut(self, request, context):
        fence = er.fence_from_pb(request)
        if request.HasField("cas_index"):
            ok = await self.registry.kv_cas(request.key, request.value, request.cas_index, fence)
        else:
            await self.registry.kv_put(request.key, request.value, fence)
            ok = True
        return registry_pb2.KvPutResponse(ok=ok)

    async def KvDelete(self, request, context):
        await self.registry.kv_delete(request.key, er.fence_from_pb(request))
        return registry_pb2.KvDeleteResponse()

    async def KvList(self, request, context):
        return self._list_response(*await self.registry.watch_prefix(request.prefix, 0, 0))

    async def WatchKey(self, request, context):
        return self._get_response(*await self.registry.watch_key(request.key, request.index, request.timeout_s))

    async def WatchPrefix(self, request, context):
        return self._list_response(*await self.registry.watch_prefix(request.prefix, request.index, request.timeout_s))

    async def AcquireLock(self, request, context):
        ok = await self.registry.acquire_lock(request.key, request.holder_id, request.ttl_s)
        return registry_pb2.LockResponse(ok=ok)

    async def RenewLock(self, request, context):
        return registry_pb2.LockResponse(ok=await self.registry.renew_lock(request.key, request.holder_id))

    async def ReleaseLock(self, request, context):
        held = await self.registry.lock_holder(request.key) == holder_name(request.holder_id)
        await self.registry.release_lock(request.key, request.holder_id)
        return registry_pb2.LockResponse(ok=held)

    async def LockHolder(self, request, context):
        name = await self.registry.lock_holder(request.key)
        return registry_pb2.LockHolderResponse(held=name is not None, holder_name=name or "")

    @staticmethod
    def _get_response(index, entry) -> registry_pb2.KvGetResponse:
        return registry_pb2.KvGetResponse(index=index, entry=er.entry_to_pb(entry) if entry else None)

    @staticmethod
    def _list_response(index, entries) -> registry_pb2.KvListResponse:
        return registry_pb2.KvListResponse(index=index, entries=[er.entry_to_pb(e) for e in entries])


def add_registry_service(server: grpc.aio.Server, registry: EmbeddedRegistry) -> RegistryService:
    """Adds the Registry service to a server the caller owns (e.g. next to the scheduler's own service);
    the caller lists SERVICE_NAME in its health and reflection, and makes the server with
    StatusInterceptor(log, ERROR_CODES) so that bad keys and records are answered INVALID_ARGUMENT."""
    servicer = RegistryService(registry)
    registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
    return servicer


class RegistryServer:
    """The embedded registry on its own gRPC server, with health and reflection (grpcurl can use it)."""

    def __init__(self, registry: EmbeddedRegistry | None = None, host: str = "127.0.0.1", port: int = 0,
                 tls: Tls | None = None):
        self._owns_registry = registry is None
        self.registry = registry or EmbeddedRegistry()
        self.host = host
        self.server = grpc_server.new_server([StatusInterceptor(log, ERROR_CODES),
                                              *([roles.RoleInterceptor(ROLE_POLICY)] if tls else [])],
                                             MAX_REQUEST_BYTES)
        add_registry_service(self.server, self.registry)
        self.health = grpc_server.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = grpc_server.bind(self.server, host, port, tls.server_credentials() if tls else None)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        metrics.announce("registry")
        await grpc_server.set_serving(self.health, [SERVICE_NAME], True)

    async def stop(self, grace: float | None = 1.0) -> None:
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace)
        if self._owns_registry:
            await self.registry.close()


async def start_registry_server(host: str = "127.0.0.1", port: int = 0, registry: EmbeddedRegistry | None = None,
                                tls: Tls | None = None) -> RegistryServer:
    """Starts serving the embedded registry on host:port (0: a free port; mutual TLS with tls); see
    RegistryServer.address."""
    server = RegistryServer(registry, host, port, tls)
    await server.start()
    return server


async def serve_registry(host: str, port: int, tls: Tls | None = None) -> None:
    """`stagemesh registry`: the embedded registry on its own, until a signal."""
    server = await start_registry_server(host, port, tls=tls)
    on_reload(tls and tls.reload)
    print(f"registry ready on {server.address}", flush=True)
    await until_signalled()
    await server.stop()
