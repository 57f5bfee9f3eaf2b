"""The embedded registry's gRPC client (the server is registry/): watches wait on the server, not by
polling. Also the wire conversions the server shares."""

from __future__ import annotations

import grpc

from stagemesh import grpc_server
from stagemesh.discovery.registry import (
    MAX_WAIT_S,
    Fence,
    KVEntry,
    LockHeld,
    LockLost,
    RegistryError,
    ServiceRecord,
    ServiceStatus,
    check_key,
    check_ttl,
)
from stagemesh.tls import Tls
from stagemesh.v1 import registry_pb2, registry_pb2_grpc


def record_to_pb(record: ServiceRecord) -> registry_pb2.ServiceRecord:
    return registry_pb2.ServiceRecord(service_id=record.service_id, address=record.address, model=record.model,
                                      meta=record.meta)


def record_from_pb(pb: registry_pb2.ServiceRecord) -> ServiceRecord:
    return ServiceRecord(pb.service_id, pb.address, pb.model, dict(pb.meta))


def statuses_to_pb(index: int, statuses: list[ServiceStatus]) -> registry_pb2.ServicesResponse:
    return registry_pb2.ServicesResponse(index=index, services=[
        registry_pb2.ServiceStatus(record=record_to_pb(s.record), passing=s.passing) for s in statuses])


def statuses_from_pb(pb: registry_pb2.ServicesResponse) -> tuple[int, list[ServiceStatus]]:
    return pb.index, [ServiceStatus(record_from_pb(s.record), s.passing) for s in pb.services]


def entry_to_pb(entry: KVEntry) -> registry_pb2.KvEntry:
    return registry_pb2.KvEntry(key=entry.key, value=entry.value, modify_index=entry.modify_index)


def entry_from_pb(pb: registry_pb2.KvEntry) -> KVEntry:
    return KVEntry(pb.key, pb.value, pb.modify_index)


def fence_to_pb(fence: Fence | None) -> registry_pb2.Fence | None:
    return registry_pb2.Fence(lock_key=fence.lock_key, holder_id=fence.holder_id) if fence else None


def fence_from_pb(request) -> Fence | None:
    """The fence of a KvPut or KvDelete request; None for one without (or any other request)."""
    if not isinstance(request, registry_pb2.KvPutRequest | registry_pb2.KvDeleteRequest) or \
            not request.HasField("fence"):
        return None
    return Fence(request.fence.lock_key, request.fence.holder_id)


class EmbeddedRegistryClient:
    """Implements discovery.registry.Registry over the stagemesh.v1.Registry gRPC service (see
    registry/service.py). Watches are server-side waits bounded by their timeout. With tls, mutual TLS
    against the mesh CA (the registry server then requires it)."""

    def __init__(self, address: str, call_timeout_s: float = 5.0, tls: Tls | None = None):
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.tls = tls
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.RegistryStub | None = None

    async def _call(self, method: str, request, wait_s: float = 0.0):
        if self._stub is None:  # made on first use, inside the caller's event loop
            self._channel = grpc_server.channel(self.address, self.tls)
            self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        try:
            return await getattr(self._stub, method)(request, timeout=min(wait_s, MAX_WAIT_S) + self.call_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # a fenced write's refusal, or a held lock's key
                raise (LockLost if fence_from_pb(request) else LockHeld)(e.details()) from e
            raise RegistryError(f"registry {method} at {self.address} failed ({e.code().name}: {e.details()}); "
                                f"is the scheduler that hosts the registry running there?") from e

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def register(self, record: ServiceRecord, ttl_s: float, deregister_after_s: float | None = None) -> None:
        record.validate()
        check_ttl("ttl_s", ttl_s)
        await self._call("Register", registry_pb2.RegisterRequest(
            record=record_to_pb(record), ttl_s=ttl_s, deregister_after_s=deregister_after_s or 0.0))

    async def heartbeat(self, service_id: str) -> bool:
        return (await self._call("Heartbeat", registry_pb2.HeartbeatRequest(service_id=service_id))).known

    async def deregister(self, service_id: str) -> None:
        await self._call("Deregister", registry_pb2.DeregisterRequest(service_id=service_id))

    async def services(self, model: str | None = None) -> list[ServiceStatus]:
        response = await self._call("ListServices", registry_pb2.ListServicesRequest(model=model or ""))
        return statuses_from_pb(response)[1]

    async def watch_services(self, index: int, timeout_s: float,
                             model: str | None = None) -> tuple[int, list[ServiceStatus]]:
        request = registry_pb2.WatchServicesRequest(index=index, timeout_s=timeout_s, model=model or "")
        return statuses_from_pb(await self._call("WatchServices", request, timeout_s))

    async def kv_get(self, key: str) -> tuple[bytes | None, int]:
        response = await self._call("KvGet", registry_pb2.KvGetRequest(key=key))
        return (response.entry.value, response.entry.modify_index) if response.HasField("entry") else (None, 0)

    async def kv_put(self, key: str, value: bytes, fence: Fence | None = None) -> None:
        check_key(key, value)
        await self._call("KvPut", registry_pb2.KvPutRequest(key=key, value=value, fence=fence_to_pb(fence)))

    async def kv_cas(self, key: str, value: bytes, index: int, fence: Fence | None = None) -> bool:
        check_key(key, value)
        request = registry_pb2.KvPutRequest(key=key, value=value, cas_index=index, fence=fence_to_pb(fence))
        return (await self._call("KvPut", request)).ok

    async def kv_delete(self, key: str, fence: Fence | None = None) -> None:
        await self._call("KvDelete", registry_pb2.KvDeleteRequest(key=key, fence=fence_to_pb(fence)))

    async def kv_list(self, prefix: str) -> list[KVEntry]:
        response = await self._call("KvList", registry_pb2.KvListRequest(prefix=prefix))
        return [entry_from_pb(e) for e in response.entries]

    async def watch_key(self, key: str, index: int, timeout_s: float) -> tuple[int, KVEntry | None]:
        request = registry_pb2.WatchKeyRequest(key=key, index=index, timeout_s=timeout_s)
        response = await self._call("WatchKey", request, timeout_s)
        return response.index, entry_from_pb(response.entry) if response.HasField("entry") else None

    async def watch_prefix(self, prefix: str, index: int, timeout_s: float) -> tuple[int, list[KVEntry]]:
        request = registry_pb2.WatchPrefixRequest(prefix=prefix, index=index, timeout_s=timeout_s)
        response = await self._call("WatchPrefix", request, timeout_s)
        return response.index, [entry_from_pb(e) for e in response.entries]

    async def acquire_lock(self, key: str, holder_id: str, ttl_s: float) -> bool:
        request = registry_pb2.LockRequest(key=key, holder_id=holder_id, ttl_s=ttl_s)
        return (await self._call("AcquireLock", request)).ok

    async def renew_lock(self, key: str, holder_id: str) -> bool:
        return (await self._call("RenewLock", registry_pb2.LockRequest(key=key, holder_id=holder_id))).ok

    async def release_lock(self, key: str, holder_id: str) -> None:
        await self._call("ReleaseLock", registry_pb2.LockRequest(key=key, holder_id=holder_id))

    async def lock_holder(self, key: str) -> str | None:
        response = await self._call("LockHolder", registry_pb2.LockHolderRequest(key=key))
        return response.holder_name if response.held else None
