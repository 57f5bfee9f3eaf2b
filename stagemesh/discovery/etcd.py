"""The etcd backend of discovery.registry.Registry: the etcd v3 gRPC API through etcd3aio (grpc.aio).

Indexes are etcd revisions (cluster-wide, only growing); a KV entry's modify_index is its mod_revision.

Services: each is two keys under SERVICES_PREFIX, on two leases that heartbeat() keeps alive:
- "<id>": the record (JSON), on a lease of ttl_s + deregister_after_s;
- "<id>/alive": an empty marker, on a lease of ttl_s.
A registrant that stops heartbeating loses the marker after ttl_s (critical: listed, not passing) and
the record deregister_after_s later (removed); etcd expires both itself, so no process has to reap.
etcd leases are whole seconds and at least the server's minimum (1.5 election timeouts, 2 s with
etcd's defaults): ttl_s is rounded up to that.

KV check-and-set is a transaction comparing the key's mod_revision (0: its create_revision, absent); a fenced
write is a transaction that also compares the lock key's lease with the holder's own (a lapsed lease took the
key with it);
watches are etcd watches from the caller's revision + 1, so nothing between two calls is missed.
Locks: the key is created in a transaction (only if absent) on a lease of the candidate's own; renewing
is a keep-alive of that lease, releasing revokes it (which deletes the key); a dead holder's lease
lapses after ttl_s and the key with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import grpc
from etcd3aio import EtcdError, EtcdPermissionDeniedError, EtcdUnauthenticatedError, prefix_range_end
from etcd3aio.auth import AuthService
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from stagemesh.discovery.registry import (
    MAX_WAIT_S,
    Fence,
    KVEntry,
    LockLost,
    RegistryError,
    ServiceRecord,
    ServiceStatus,
    check_holder_id,
    check_key,
    check_ttl,
    holder_name,
)

SERVICES_PREFIX = "stagemesh-services/"
"""Where service records live (beside, not under, the per-model "stagemesh/<model>/" keys)."""
ALIVE = "/alive"


def _service_key(service_id: str) -> bytes:
    return (SERVICES_PREFIX + service_id).encode()


def _alive_key(service_id: str) -> bytes:
    return (SERVICES_PREFIX + service_id + ALIVE).encode()


def _seconds(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s))


def _entry(kv) -> KVEntry:
    return KVEntry(kv.key.decode(), kv.value, kv.mod_revision)


class EtcdRegistry:
    """Implements discovery.registry.Registry against an etcd v3 cluster (one channel, round-robin over the
    members' client URLs; a member that goes away is skipped)."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None, user: tuple[str, str] | None = None,
                 call_timeout_s: float = 5.0, address: str = ""):
        """target: a gRPC target naming every member ("ipv4:h1:p1,h2:p2" or "dns:///name:port");
        credentials: TLS (None: plaintext); server_name: the name the members' certificates carry when
        the target is a list of addresses; user: (name, password) for a cluster with auth enabled."""
        self.target = target
        self.address = address or target
        self.call_timeout_s = call_timeout_s
        self._credentials = credentials
        self._server_name = server_name
        self._user = user
        self._token_ok = False
        self._channel: grpc.aio.Channel | None = None
        self._leases: dict[str, tuple] = {}  # service_id -> (alive lease, record lease, their TTLs asked)
        self._locks: dict[tuple[str, str], int] = {}  # (lock key, holder_id) -> lease

    # Connection and errors

    async def _connect(self) -> None:
        """Made on first use, inside the caller's event loop."""
        options = [("grpc.lb_policy_name", "round_robin"), ("grpc.keepalive_time_ms", 10_000),
                   ("grpc.keepalive_timeout_ms", 5_000), ("grpc.keepalive_permit_without_calls", 1)]
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        else:
            if self._server_name:
                options.append(("grpc.ssl_target_name_override", self._server_name))
            self._channel = grpc.aio.secure_channel(self.target, self._credentials, options=options)
        self.kv = KVService(self._channel)
        self.lease = LeaseService(self._channel)
        self.watch = WatchService(self._channel, reconnect_backoff_seconds=0.1, max_reconnect_backoff_seconds=1.0)

    async def _authenticate(self) -> None:
        """A token for the user's name and password, on every call from now on (etcd tokens lapse, and a
        member that restarts forgets them: the call that finds it stale fails, the next authenticates)."""
        token = (await AuthService(self._channel).authenticate(*self._user, timeout=self.call_timeout_s)).token
        for service in (self.kv, self.lease, self.watch):
            service.set_token(token)
        self._token_ok = True

    @contextlib.asynccontextmanager
    async def _errors(self, what: str):
        """Failures reaching etcd become RegistryError saying what to check."""
        try:
            if self._channel is None:
                await self._connect()
            if self._user and not self._token_ok:
                await self._authenticate()
            yield
        except EtcdUnauthenticatedError as e:
            self._token_ok = False
            raise RegistryError(f"etcd at {self.address} refused {what} ({e}); check ETCDCTL_USER") from e
        except EtcdPermissionDeniedError as e:
            raise RegistryError(f"etcd at {self.address} denied {what} ({e}): grant the user read and write "
                                f"on the stagemesh/ and {SERVICES_PREFIX} prefixes") from e
        except (EtcdError, grpc.aio.AioRpcError, TimeoutError) as e:
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._token_ok = False  # from a stream (keep-alive, watch), which etcd3aio does not map
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            raise RegistryError(f"etcd at {self.address}: {what} failed ({detail or type(e).__name__}); "
                                f"is the cluster running, reachable and with a quorum of members?") from e

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _range(self, key: bytes, prefix: bool = False):
        async with self._errors("a read"):
            return await self.kv.get(key, range_end=prefix_range_end(key) if prefix else None,
                                     timeout=self.call_timeout_s)

    async def _keep_alive(self, lease: int) -> bool:
        """Renews a lease once; False: it expired or was revoked. A stream that breaks (its member died) is
        opened again, on another member, until call_timeout_s."""
        async with self._errors("a lease keep-alive"), asyncio.timeout(self.call_timeout_s):
            while True:
                call = self.lease.keep_alive(lease)
                try:
                    async for response in call:
                        return response.TTL > 0
                    return False
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                        raise
                finally:
                    call.cancel()
                await asyncio.sleep(0.1)

    async def _revoke(self, *leases: int) -> None:
        async with self._errors("a lease revoke"):
            for lease in leases:
                with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND: expired already
                    await self.lease.revoke(lease, timeout=self.call_timeout_s)

    async def _changed(self, key: bytes, prefix: bool, index: int, timeout_s: float) -> bool:
        """Waits until the key (or a key under the prefix) changed after revision index; False after timeout_s."""
        if index <= 0 or timeout_s <= 0:
            return False
        async with self._errors("a watch"):
            stream = self.watch.watch(key, prefix_range_end(key) if prefix else None, start_revision=index + 1)
            try:
                async with asyncio.timeout(min(timeout_s, MAX_WAIT_S)):
                    async for response in stream:
                        if response.events or response.compact_revision or response.canceled:
                            return True
            except TimeoutError:
                return False
            finally:
                await stream.aclose()
        return True  # the stream ended: read again

    # Services

    async def register(self, record: ServiceRecord, ttl_s: float, deregister_after_s: float | None = None) -> None:
        """Registering again with the same TTLs keeps the leases while they live (a registrant that lost
        a heartbeat to a dying member must not lose its place while it registers again)."""
        record.validate()
        check_ttl("ttl_s", ttl_s)
        after = 3 * ttl_s if deregister_after_s is None else deregister_after_s
        timings = (_seconds(ttl_s), _seconds(after))
        previous = self._leases.get(record.service_id)
        leases = None
        if previous and previous[2] == timings and await self._keep_alive(previous[0]) \
                and await self._keep_alive(previous[1]):
            leases = previous
        async with self._errors(f"registering {record.service_id}"):
            if leases is None:
                alive = await self.lease.grant(timings[0], timeout=self.call_timeout_s)
                kept = await self.lease.grant(alive.TTL + timings[1], timeout=self.call_timeout_s)
                leases = (alive.ID, kept.ID, timings)
            value = json.dumps({"address": record.address, "model": record.model, "meta": record.meta,
                                "leases": list(leases[:2])}).encode()
            await self.kv.txn([], [KVService.txn_op_put(_service_key(record.service_id), value, lease=leases[1]),
                                   KVService.txn_op_put(_alive_key(record.service_id), b"", lease=leases[0])],
                              timeout=self.call_timeout_s)
        self._leases[record.service_id] = leases
        if previous and previous is not leases:  # the keys moved to the new leases: this deletes nothing
            await self._revoke(*previous[:2])

    async def _service_leases(self, service_id: str) -> tuple[int, int] | None:
        leases = self._leases.get(service_id, ())[:2] or None
        if leases is None:  # registered by another client (or process): the record names its leases
            response = await self._range(_service_key(service_id))
            if not response.kvs:
                return None
            with contextlib.suppress(ValueError, KeyError, TypeError):
                alive, kept = json.loads(response.kvs[0].value)["leases"]
                leases = (int(alive), int(kept))
        return leases

    async def heartbeat(self, service_id: str) -> bool:
        leases = await self._service_leases(service_id)
        if leases is None or not await self._keep_alive(leases[0]) or not await self._keep_alive(leases[1]):
            self._leases.pop(service_id, None)
            return False
        return True

    async def deregister(self, service_id: str) -> None:
        leases = await self._service_leases(service_id)
        self._leases.pop(service_id, None)
        if leases:
            await self._revoke(*leases)
        async with self._errors(f"deregistering {service_id}"):
            await self.kv.txn([], [KVService.txn_op_delete(_service_key(service_id)),
                                   KVService.txn_op_delete(_alive_key(service_id))], timeout=self.call_timeout_s)

    async def services(self, model: str | None = None) -> list[ServiceStatus]:
        return (await self.watch_services(0, 0, model))[1]

    async def watch_services(self, index: int, timeout_s: float,
                             model: str | None = None) -> tuple[int, list[ServiceStatus]]:
        changed = await self._changed(SERVICES_PREFIX.encode(), True, index, timeout_s)
        response = await self._range(SERVICES_PREFIX.encode(), prefix=True)
        names = {kv.key.decode()[len(SERVICES_PREFIX):]: kv.value for kv in response.kvs}
        statuses = []
        for service_id, value in names.items():
            if service_id.endswith(ALIVE):
                continue
            try:
                fields = json.loads(value)
                record = ServiceRecord(service_id, fields["address"], fields["model"], dict(fields["meta"]))
            except (ValueError, KeyError, TypeError):
                continue  # not written by register(): not a service
            if model is None or record.model == model:
                statuses.append(ServiceStatus(record, service_id + ALIVE in names))
        return (response.header.revision if changed or index <= 0 else index), statuses

    # KV

    async def kv_get(self, key: str) -> tuple[bytes | None, int]:
        check_key(key)
        response = await self._range(key.encode())
        return (response.kvs[0].value, response.kvs[0].mod_revision) if response.kvs else (None, 0)

    async def kv_put(self, key: str, value: bytes, fence: Fence | None = None) -> None:
        check_key(key, value)
        if fence is None:
            async with self._errors(f"writing {key!r}"):
                await self.kv.put(key.encode(), value, timeout=self.call_timeout_s)
        else:
            await self._fenced_txn(fence, [], KVService.txn_op_put(key.encode(), value), f"writing {key!r}")

    async def kv_cas(self, key: str, value: bytes, index: int, fence: Fence | None = None) -> bool:
        check_key(key, value)
        compare = (KVService.txn_compare_create_revision(key.encode(), 0) if index == 0 else
                   self._compare(key.encode(), "MOD", mod_revision=index))
        return await self._fenced_txn(fence, [compare], KVService.txn_op_put(key.encode(), value), f"writing {key!r}")

    async def _fenced_txn(self, fence: Fence | None, compares: list, op, what: str) -> bool:
        """One transaction: op if every compare holds and (with a fence) the lock's key is still on its holder's
        lease; LockLost when the fence failed, False when only a compare did."""
        lease = None
        if fence is not None:
            lease = self._locks.get((fence.lock_key, fence.holder_id))
            if lease is None:
                raise LockLost(f"the write's fence {fence.lock_key!r} is not held by its holder: nothing written")
            compares = [self._compare(fence.lock_key.encode(), "LEASE", lease=lease), *compares]
        async with self._errors(what):
            response = await self.kv.txn(compares, [op], [KVService.txn_op_get(fence.lock_key.encode())] if fence
                                         else [], timeout=self.call_timeout_s)
        if not response.succeeded and fence is not None:
            held = response.responses[0].response_range.kvs
            if not (held and held[0].lease == lease):
                raise LockLost(f"the write's fence {fence.lock_key!r} is no longer held by its holder (its lease "
                               "lapsed or another holder took it): nothing written")
        return response.succeeded

    @staticmethod
    def _compare(key: bytes, target: str, **field):
        """A compare etcd3aio does not build (MOD, LEASE): its VERSION compare with the target and field set."""
        compare = KVService.txn_compare_version(key, 0)
        compare.target = getattr(type(compare), target)
        for name, value in field.items():
            setattr(compare, name, value)
        return compare

    async def kv_delete(self, key: str, fence: Fence | None = None) -> None:
        check_key(key)
        if fence is None:
            async with self._errors(f"deleting {key!r}"):
                await self.kv.delete(key.encode(), timeout=self.call_timeout_s)
        else:
            await self._fenced_txn(fence, [], KVService.txn_op_delete(key.encode()), f"deleting {key!r}")

    async def kv_list(self, prefix: str) -> list[KVEntry]:
        return (await self.watch_prefix(prefix, 0, 0))[1]

    async def watch_key(self, key: str, index: int, timeout_s: float) -> tuple[int, KVEntry | None]:
        check_key(key)
        changed = await self._changed(key.encode(), False, index, timeout_s)
        response = await self._range(key.encode())
        entry = _entry(response.kvs[0]) if response.kvs else None
        return (response.header.revision if changed or index <= 0 else index), entry

    async def watch_prefix(self, prefix: str, index: int, timeout_s: float) -> tuple[int, list[KVEntry]]:
        if prefix.startswith("/") or not prefix:
            raise ValueError(f"prefix {prefix!r}: use a non-empty prefix without a leading '/'")
        changed = await self._changed(prefix.encode(), True, index, timeout_s)
        response = await self._range(prefix.encode(), prefix=True)
        entries = sorted((_entry(kv) for kv in response.kvs), key=lambda e: e.key)
        return (response.header.revision if changed or index <= 0 else index), entries

    # Locks

    async def acquire_lock(self, key: str, holder_id: str, ttl_s: float) -> bool:
        check_key(key)
        check_ttl("ttl_s", ttl_s)
        check_holder_id(holder_id)
        lease = self._locks.get((key, holder_id))
        if lease is not None and not await self._keep_alive(lease):
            lease = None
        async with self._errors(f"taking the lock {key!r}"):
            if lease is None:  # a candidate keeps its lease between tries: one lease each, not one a try
                lease = (await self.lease.grant(_seconds(ttl_s), timeout=self.call_timeout_s)).ID
                self._locks[(key, holder_id)] = lease
            name = holder_name(holder_id).encode()
            response = await self.kv.txn([KVService.txn_compare_create_revision(key.encode(), 0)],
                                         [KVService.txn_op_put(key.encode(), name, lease=lease)],
                                         [KVService.txn_op_get(key.encode())], timeout=self.call_timeout_s)
        if response.succeeded:
            return True
        held = response.responses[0].response_range.kvs
        return bool(held) and held[0].lease == lease

    async def renew_lock(self, key: str, holder_id: str) -> bool:
        lease = self._locks.get((key, holder_id))
        if lease is None:
            return False
        if not await self._keep_alive(lease):
            self._locks.pop((key, holder_id), None)
            return False
        held = (await self._range(key.encode())).kvs
        return bool(held) and held[0].lease == lease

    async def release_lock(self, key: str, holder_id: str) -> None:
        """Revokes the candidate's lease: etcd deletes the key if it held it."""
        lease = self._locks.pop((key, holder_id), None)
        if lease is not None:
            await self._revoke(lease)

    async def lock_holder(self, key: str) -> str | None:
        check_key(key)
        held = (await self._range(key.encode())).kvs
        return held[0].value.decode() if held and held[0].lease else None
