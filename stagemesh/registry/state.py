"""The embedded registry's state, in memory and pure asyncio.

EmbeddedRegistry lives in the registry server (registry/service.py serves it, on its own or next to
the scheduler); stage servers and routers elsewhere use stagemesh.discovery.embedded's client.
Nothing is persisted: after a registry restart heartbeat() returns False, so registrants register
again, and the scheduler rewrites its keys. Indexes start at the wall clock in milliseconds, above
anything a previous run handed out, so a watcher holding an old index is answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from stagemesh import metrics
from stagemesh.discovery.registry import (
    MAX_WAIT_S,
    Fence,
    KVEntry,
    LockHeld,
    LockLost,
    ServiceRecord,
    ServiceStatus,
    check_holder_id,
    check_key,
    check_ttl,
    holder_name,
)


@dataclass
class _Service:
    record: ServiceRecord
    ttl_s: float
    deregister_after_s: float
    deadline: float
    """time.monotonic() after which it is critical without a heartbeat."""
    passing: bool = True


@dataclass
class _Entry:
    value: bytes
    modify_index: int
    holder: str | None = None
    """The holder's secret id, set while the key is a held lock (the value is its holder_name); the lease ends at
    expires."""
    ttl_s: float = 0.0
    expires: float = 0.0


class EmbeddedRegistry:
    """Implements discovery.registry.Registry in process. Use it from one event loop; close() it."""

    def __init__(self) -> None:
        self._index = self._start_index = int(time.time() * 1000)
        self._services: dict[str, _Service] = {}
        self._services_index = self._start_index
        self._kv: dict[str, _Entry] = {}
        self._tombstones: dict[str, int] = {}  # key -> index of its deletion, so watches of it wake
        self._changed = asyncio.Event()  # replaced on every change: watchers await the one they saw
        self._wake_reaper = asyncio.Event()
        self._reaper: asyncio.Task | None = None

    # Changes, waits and expiry

    def _export(self) -> None:
        """The registry's gauges, after a change (a process runs one registry)."""
        passing = sum(s.passing for s in self._services.values())
        metrics.REGISTRY_SERVICES.labels("passing").set(passing)
        metrics.REGISTRY_SERVICES.labels("critical").set(len(self._services) - passing)
        metrics.REGISTRY_KV_KEYS.set(len(self._kv))

    def _bump(self) -> int:
        self._index += 1
        self._changed.set()
        self._changed = asyncio.Event()
        return self._index

    async def _wait(self, index: int, timeout_s: float, current: Callable[[], int]) -> None:
        """Returns once current() moved off index, or after timeout_s; at once for index 0."""
        deadline = time.monotonic() + min(max(timeout_s, 0.0), MAX_WAIT_S)
        if index <= 0 or current() != index:
            return
        metrics.REGISTRY_WATCHERS.inc()
        try:
            while current() == index:
                changed = self._changed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        finally:
            metrics.REGISTRY_WATCHERS.dec()

    def _start_reaper(self) -> None:
        self._wake_reaper.set()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="registry-reaper")

    async def _reap_forever(self) -> None:
        """Sleeps until the next deadline (or a new, maybe earlier one) and applies what is due."""
        while True:
            self._wake_reaper.clear()
            next_at = self._reap(time.monotonic())
            delay = None if next_at is None else max(0.0, next_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_reaper.wait(), delay)

    def _reap(self, now: float) -> float | None:
        """Marks late services critical, removes long-critical ones, frees expired locks; returns the
        time of the next such event."""
        upcoming, changed = [], False
        for service_id, s in list(self._services.items()):
            if s.passing and now >= s.deadline:
                s.passing, changed = False, True
                metrics.REGISTRY_EXPIRIES.labels("service").inc()
            if not s.passing and now >= s.deadline + s.deregister_after_s:
                del self._services[service_id]
                changed = True
                metrics.REGISTRY_EXPIRIES.labels("deregistered").inc()
            else:
                upcoming.append(s.deadline if s.passing else s.deadline + s.deregister_after_s)
        if changed:
            self._services_index = self._bump()
            self._export()
        for key, entry in list(self._kv.items()):
            if entry.holder is not None:
                if now >= entry.expires:
                    self._delete(key)
                    metrics.REGISTRY_EXPIRIES.labels("lock").inc()
                else:
                    upcoming.append(entry.expires)
        return min(upcoming, default=None)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    # Services

    async def register(self, record: ServiceRecord, ttl_s: float, deregister_after_s: float | None = None) -> None:
        record.validate()
        check_ttl("ttl_s", ttl_s)
        after = 3 * ttl_s if deregister_after_s is None else deregister_after_s
        check_ttl("deregister_after_s", after)
        self._services[record.service_id] = _Service(record.copy(), ttl_s, after, time.monotonic() + ttl_s)
        self._services_index = self._bump()
        self._export()
        self._start_reaper()

    async def heartbeat(self, service_id: str) -> bool:
        s = self._services.get(service_id)
        if s is None:
            return False
        s.deadline = time.monotonic() + s.ttl_s
        if not s.passing:
            s.passing = True
            self._services_index = self._bump()
            self._export()
        return True

    async def deregister(self, service_id: str) -> None:
        if self._services.pop(service_id, None) is not None:
            self._services_index = self._bump()
            self._export()

    async def services(self, model: str | None = None) -> list[ServiceStatus]:
        return [ServiceStatus(s.record.copy(), s.passing) for _, s in sorted(self._services.items())
                if model is None or s.record.model == model]

    async def watch_services(self, index: int, timeout_s: float,
                             model: str | None = None) -> tuple[int, list[ServiceStatus]]:
        await self._wait(index, timeout_s, lambda: self._services_index)
        return self._services_index, await self.services(model)

    # KV

    def _set(self, key: str, value: bytes) -> _Entry:
        index = self._bump()
        entry = self._kv.get(key)
        if entry is None:
            entry = self._kv[key] = _Entry(value, index)
        else:
            entry.value, entry.modify_index = value, index
        self._tombstones.pop(key, None)
        self._export()
        return entry

    def _delete(self, key: str) -> None:
        if self._kv.pop(key, None) is not None:
            self._tombstones[key] = self._bump()
            self._export()

    def _key_index(self, key: str) -> int:
        entry = self._kv.get(key)
        return entry.modify_index if entry else self._tombstones.get(key, self._start_index)

    def _prefix_index(self, prefix: str) -> int:
        indexes = [e.modify_index for k, e in self._kv.items() if k.startswith(prefix)]
        indexes += [i for k, i in self._tombstones.items() if k.startswith(prefix)]
        return max(indexes, default=self._start_index)

    def _entry(self, key: str) -> KVEntry | None:
        entry = self._kv.get(key)
        return KVEntry(key, entry.value, entry.modify_index) if entry else None

    async def kv_get(self, key: str) -> tuple[bytes | None, int]:
        check_key(key)
        entry = self._kv.get(key)
        return (entry.value, entry.modify_index) if entry else (None, 0)

    def _not_held(self, key: str) -> None:
        """LockHeld for a held lock's key: only its holder changes it, by renewing or releasing."""
        if self._held(key) is not None:
            raise LockHeld(f"key {key!r} is a held lock: only its holder releases it")

    def _fenced(self, fence: Fence | None) -> None:
        """LockLost unless the fence's holder holds its lock now (a lease past its expiry counts as lost, reaped
        or not): checked in the same step as the write, nothing can come between."""
        if fence is not None:
            held = self._held(fence.lock_key)
            if held is None or held.holder != fence.holder_id:
                raise LockLost(f"the write's fence {fence.lock_key!r} is not held by its holder (its lease lapsed or "
                               "another holder took it): nothing written")

    async def kv_put(self, key: str, value: bytes, fence: Fence | None = None) -> None:
        check_key(key, value)
        self._not_held(key)
        self._fenced(fence)
        self._set(key, value)

    async def kv_cas(self, key: str, value: bytes, index: int, fence: Fence | None = None) -> bool:
        check_key(key, value)
        self._not_held(key)
        self._fenced(fence)
        entry = self._kv.get(key)
        if (entry.modify_index if entry else 0) != index:
            return False
        self._set(key, value)
        return True

    async def kv_delete(self, key: str, fence: Fence | None = None) -> None:
        check_key(key)
        self._not_held(key)
        self._fenced(fence)
        self._delete(key)

    async def kv_list(self, prefix: str) -> list[KVEntry]:
        return [KVEntry(k, e.value, e.modify_index) for k, e in sorted(self._kv.items()) if k.startswith(prefix)]

    async def watch_key(self, key: str, index: int, timeout_s: float) -> tuple[int, KVEntry | None]:
        check_key(key)
        await self._wait(index, timeout_s, lambda: self._key_index(key))
        return self._key_index(key), self._entry(key)

    async def watch_prefix(self, prefix: str, index: int, timeout_s: float) -> tuple[int, list[KVEntry]]:
        await self._wait(index, timeout_s, lambda: self._prefix_index(prefix))
        return self._prefix_index(prefix), await self.kv_list(prefix)

    # Locks: a lock is a key whose entry carries a lease; it is deleted when released or expired.

    def _held(self, key: str) -> _Entry | None:
        entry = self._kv.get(key)
        return entry if entry and entry.holder is not None and entry.expires > time.monotonic() else None

    async def acquire_lock(self, key: str, holder_id: str, ttl_s: float) -> bool:
        check_key(key)
        check_ttl("ttl_s", ttl_s)
        check_holder_id(holder_id)
        held = self._held(key)
        if held is not None and held.holder != holder_id:
            return False
        entry = held or self._set(key, holder_name(holder_id).encode())
        entry.holder, entry.ttl_s, entry.expires = holder_id, ttl_s, time.monotonic() + ttl_s
        self._start_reaper()
        return True

    async def renew_lock(self, key: str, holder_id: str) -> bool:
        held = self._held(key)
        if held is None or held.holder != holder_id:
            return False
        held.expires = time.monotonic() + held.ttl_s
        return True

    async def release_lock(self, key: str, holder_id: str) -> None:
        held = self._held(key)
        if held is not None and held.holder == holder_id:
            self._delete(key)

    async def lock_holder(self, key: str) -> str | None:
        held = self._held(key)
        return holder_name(held.holder) if held else None
