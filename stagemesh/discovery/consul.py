"""The Consul backend of discovery.registry.Registry, through py-consul.

py-consul 1.8.0 has consul.aio, but it needs aiohttp, which stagemesh does not install; so the sync
client runs on thread pools of our own: blocking queries hold a thread for up to their wait, and must
starve neither asyncio.to_thread's default pool nor our own heartbeats (watches have their own pool).

Liveness: every service gets two checks and is passing only while both (and its node) pass:
- a gRPC health check Consul runs against the service's own grpc.health.v1 endpoint every second,
  which catches a dead process or one that stopped serving, whoever registered it;
- a TTL check that heartbeat() passes, for the same contract as the embedded registry (a registrant
  that stops heartbeating turns critical), and so that a wedged registrant is noticed too.
Consul removes a service critical for DeregisterCriticalServiceAfter, which it floors at 1 minute and
reaps every 30 s: removal takes 60-90 s whatever deregister_after_s asks. The gRPC check is performed
by the agent the service is registered with: it must reach the service's address.

Locks are Consul sessions (TTL, behavior=delete, Consul's default lock-delay of 15 s: after a holder's
session is invalidated nobody takes the lock for that long, so writes the old holder had in flight land before a
new holder acts) and `kv put ?acquire=`. Consul's session TTL is 10 s at least and an abandoned session may live
up to twice its TTL. A clean release first releases the key (which starts no lock-delay), then destroys the
session. A fenced write is a transaction whose first operation is `check-session` on the lock's key.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import consul
import requests
from consul.exceptions import ClientError

from stagemesh.discovery.registry import (
    MAX_WAIT_S,
    SERVICE_NAME,
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
    split_address,
)

GRPC_CHECK_INTERVAL_S = 1.0
MIN_DEREGISTER_AFTER_S = 60.0  # Consul's floor for DeregisterCriticalServiceAfter
MIN_SESSION_TTL_S = 10  # Consul's floor for a session TTL


def _duration(seconds: float) -> str:
    """A Go duration string, as Consul wants."""
    return f"{max(seconds, 0.001):.3f}s"


def _check_ids(service_id: str) -> tuple[str, str]:
    return f"service:{service_id}:grpc", f"service:{service_id}:ttl"


def _status(node: dict) -> ServiceStatus:
    """One entry of /v1/health/service -> ServiceStatus."""
    service = node["Service"]
    meta = dict(service.get("Meta") or {})
    model = meta.pop("model", "")
    host = service.get("Address") or node["Node"]["Address"]
    address = f"[{host}]:{service['Port']}" if ":" in host else f"{host}:{service['Port']}"
    passing = all(check["Status"] == "passing" for check in node.get("Checks") or [])
    return ServiceStatus(ServiceRecord(service["ID"], address, model, meta), passing)


def _kv_entry(item: dict) -> KVEntry:
    return KVEntry(item["Key"], item.get("Value") or b"", int(item["ModifyIndex"]))


class ConsulRegistry:
    """Implements discovery.registry.Registry against a Consul agent's HTTP API."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8500, token: str | None = None, max_watches: int = 32,
                 scheme: str = "http", verify: bool | str = True, cert: tuple[str, str] | None = None,
                 grpc_check_tls: bool = False):
        """scheme "https" verifies the agent against `verify` (a CA file, or True: the system's CAs) and
        presents `cert` (certificate, key) if given; grpc_check_tls: the services registered serve TLS, so
        the agent's gRPC health checks must dial them with TLS."""
        self.address = f"{host}:{port}"
        self.grpc_check_tls = grpc_check_tls
        self._consul = consul.Consul(host=host, port=port, token=token, scheme=scheme, verify=verify, cert=cert)
        self._calls = ThreadPoolExecutor(4, thread_name_prefix="consul")
        self._watches = ThreadPoolExecutor(max_watches, thread_name_prefix="consul-watch")
        self._sessions: dict[tuple[str, str], str] = {}  # (lock key, holder_id) -> session id

    async def _run(self, fn, *args, _pool: ThreadPoolExecutor | None = None, **kwargs):
        """Runs one py-consul call on a thread; failures become RegistryError saying what to check."""
        call = functools.partial(fn, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(_pool or self._calls, call)
        except consul.ACLPermissionDenied as e:
            raise RegistryError(f"consul at {self.address} denied {fn.__qualname__}: set CONSUL_HTTP_TOKEN to a "
                                f"token with service, key and session write rights ({e})") from e
        except (consul.ConsulException, requests.RequestException) as e:
            raise RegistryError(f"consul at {self.address}: {fn.__qualname__} failed ({e}); "
                                f"is the agent running and reachable?") from e

    async def _blocking(self, fn, *args, index: int, timeout_s: float, **kwargs):
        """A Consul blocking query, repeated until the index moves or timeout_s passes (Consul may
        answer early with the same index). Index 0 answers at once."""
        deadline = time.monotonic() + min(max(timeout_s, 0.0), MAX_WAIT_S)
        while True:
            remaining = deadline - time.monotonic()
            blocking = index > 0 and remaining > 0
            new_index, data = await self._run(fn, *args, index=index if blocking else None,
                                              wait=_duration(remaining) if blocking else None,
                                              _pool=self._watches if blocking else None, **kwargs)
            new_index = int(new_index)
            if not blocking or new_index != index or time.monotonic() >= deadline:
                return new_index, data

    async def close(self) -> None:
        for pool in (self._calls, self._watches):
            pool.shutdown(wait=False, cancel_futures=True)

    # Services

    async def register(self, record: ServiceRecord, ttl_s: float, deregister_after_s: float | None = None) -> None:
        record.validate()
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive seconds, got {ttl_s!r}")
        host, port = split_address(record.address)
        after = _duration(max(3 * ttl_s if deregister_after_s is None else deregister_after_s, MIN_DEREGISTER_AFTER_S))
        grpc_id, ttl_id = _check_ids(record.service_id)
        grpc_check = {"CheckID": grpc_id, "Name": "grpc.health.v1 of the stage server",
                      **consul.Check.grpc(record.address, _duration(GRPC_CHECK_INTERVAL_S),
                                          use_tls=self.grpc_check_tls or None,
                                          timeout=_duration(GRPC_CHECK_INTERVAL_S), deregister=after)}
        ttl_check = {"CheckID": ttl_id, "Name": "stagemesh heartbeat", "Status": "passing",
                     **consul.Check.ttl(_duration(ttl_s)), "DeregisterCriticalServiceAfter": after}
        tags = [f"model={record.model}", f"layers={record.meta.get('layers', '')}"]
        await self._run(self._consul.agent.service.register, SERVICE_NAME, service_id=record.service_id,
                        address=host, port=port, tags=tags, meta={**record.meta, "model": record.model},
                        check=grpc_check, extra_checks=[ttl_check], replace_existing_checks=True)

    async def heartbeat(self, service_id: str) -> bool:
        try:
            return bool(await self._run(self._consul.agent.check.ttl_pass, _check_ids(service_id)[1]))
        except RegistryError as e:
            cause = str(e.__cause__).lower()  # older agents answer 500, not 404, for an unknown check
            if "unknown" in cause or "does not have associated ttl" in cause:
                return False
            raise

    async def deregister(self, service_id: str) -> None:
        try:
            await self._run(self._consul.agent.service.deregister, service_id)
        except RegistryError as e:
            if "unknown" not in str(e.__cause__).lower():
                raise

    async def services(self, model: str | None = None) -> list[ServiceStatus]:
        return (await self.watch_services(0, 0, model))[1]

    async def watch_services(self, index: int, timeout_s: float,
                             model: str | None = None) -> tuple[int, list[ServiceStatus]]:
        new_index, nodes = await self._blocking(self._consul.health.service, SERVICE_NAME,
                                                index=index, timeout_s=timeout_s)
        statuses = [_status(n) for n in nodes or []]
        statuses = [s for s in statuses if model is None or s.record.model == model]
        return new_index, sorted(statuses, key=lambda s: s.record.service_id)

    # KV

    async def kv_get(self, key: str) -> tuple[bytes | None, int]:
        check_key(key)
        _, item = await self._run(self._consul.kv.get, key)
        return (item.get("Value") or b"", int(item["ModifyIndex"])) if item else (None, 0)

    async def kv_put(self, key: str, value: bytes, fence: Fence | None = None) -> None:
        check_key(key, value)
        if fence is not None:
            await self._fenced_txn(fence, {"Verb": "set", "Key": key, "Value": base64.b64encode(value).decode()})
        elif not await self._run(self._consul.kv.put, key, value):
            raise RegistryError(f"consul at {self.address} refused to write {key!r}")

    async def kv_cas(self, key: str, value: bytes, index: int, fence: Fence | None = None) -> bool:
        check_key(key, value)
        if fence is not None:
            return await self._fenced_txn(fence, {"Verb": "cas", "Key": key, "Index": index,
                                                  "Value": base64.b64encode(value).decode()})
        return bool(await self._run(self._consul.kv.put, key, value, cas=index))

    async def kv_delete(self, key: str, fence: Fence | None = None) -> None:
        check_key(key)
        if fence is not None:
            await self._fenced_txn(fence, {"Verb": "delete", "Key": key})
        else:
            await self._run(self._consul.kv.delete, key)

    async def _fenced_txn(self, fence: Fence, op: dict) -> bool:
        """op in one transaction after a check-session of the lock's key against its holder's session; LockLost
        when the check failed, False when op's own check (a cas) did."""
        session = self._sessions.get((fence.lock_key, fence.holder_id))
        if session is None:
            raise LockLost(f"the write's fence {fence.lock_key!r} is not held by its holder: nothing written")
        ops = [{"KV": {"Verb": "check-session", "Key": fence.lock_key, "Session": session}}, {"KV": op}]
        try:
            await self._run(self._consul.txn.put, ops)
            return True
        except RegistryError as e:
            if not isinstance(e.__cause__, ClientError) or "409" not in str(e.__cause__):
                raise
            body = str(e.__cause__).partition(" ")[2]
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                if all(error.get("OpIndex") != 0 for error in json.loads(body).get("Errors") or []):
                    return False  # only op's own check failed: the lock is still held
            raise LockLost(f"the write's fence {fence.lock_key!r} is no longer held by its holder (its session "
                           "lapsed or another holder took it): nothing written") from e

    async def kv_list(self, prefix: str) -> list[KVEntry]:
        return (await self.watch_prefix(prefix, 0, 0))[1]

    async def watch_key(self, key: str, index: int, timeout_s: float) -> tuple[int, KVEntry | None]:
        check_key(key)
        new_index, item = await self._blocking(self._consul.kv.get, key, index=index, timeout_s=timeout_s)
        return new_index, _kv_entry(item) if item else None

    async def watch_prefix(self, prefix: str, index: int, timeout_s: float) -> tuple[int, list[KVEntry]]:
        if prefix.startswith("/"):
            raise ValueError(f"prefix {prefix!r}: drop the leading '/'")
        new_index, items = await self._blocking(self._consul.kv.get, prefix, recurse=True,
                                                index=index, timeout_s=timeout_s)
        return new_index, sorted((_kv_entry(i) for i in items or []), key=lambda e: e.key)

    # Locks

    async def _session(self, key: str, holder_id: str, ttl_s: float) -> str:
        """This candidate's session for key: renewed if it still exists, else a new one."""
        session = self._sessions.get((key, holder_id))
        if session is not None and await self._renew(session):
            return session
        session = await self._run(self._consul.session.create, name=f"stagemesh lock {key} {holder_name(holder_id)}",
                                  behavior="delete", ttl=max(MIN_SESSION_TTL_S, math.ceil(ttl_s)))
        self._sessions[(key, holder_id)] = session
        return session

    async def _renew(self, session: str) -> bool:
        try:
            await self._run(self._consul.session.renew, session)
            return True
        except RegistryError as e:
            if isinstance(e.__cause__, consul.NotFound):
                return False
            raise

    async def acquire_lock(self, key: str, holder_id: str, ttl_s: float) -> bool:
        check_key(key)
        check_ttl("ttl_s", ttl_s)
        check_holder_id(holder_id)
        session = await self._session(key, holder_id, ttl_s)
        try:
            return bool(await self._run(self._consul.kv.put, key, holder_name(holder_id).encode(), acquire=session))
        except RegistryError as e:
            if "session" in str(e.__cause__).lower():  # it expired between renew and put: try again later
                self._sessions.pop((key, holder_id), None)
                return False
            raise

    async def renew_lock(self, key: str, holder_id: str) -> bool:
        session = self._sessions.get((key, holder_id))
        if session is None:
            return False
        if not await self._renew(session):
            self._sessions.pop((key, holder_id), None)
            return False
        _, item = await self._run(self._consul.kv.get, key)
        return bool(item) and item.get("Session") == session

    async def release_lock(self, key: str, holder_id: str) -> None:
        """Releases the key (no lock-delay follows a release, unlike an invalidated session), deletes it unless
        another holder took it meanwhile, and destroys the session."""
        session = self._sessions.pop((key, holder_id), None)
        if session is None:
            return
        if await self._run(self._consul.kv.put, key, holder_name(holder_id).encode(), release=session):
            index, item = await self._run(self._consul.kv.get, key)
            if item and not item.get("Session"):
                await self._run(self._consul.kv.delete, key, cas=int(item["ModifyIndex"]))
        await self._run(self._consul.session.destroy, session)

    async def lock_holder(self, key: str) -> str | None:
        check_key(key)
        _, item = await self._run(self._consul.kv.get, key)
        return (item.get("Value") or b"").decode() if item and item.get("Session") else None
