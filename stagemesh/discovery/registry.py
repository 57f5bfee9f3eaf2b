"""The registry interface: service discovery with liveness, a KV store with blocking watches, leader locks.

Three backends implement it with the same semantics (tests/test_registry_contract.py holds them to it):
the embedded one (registry/, its own server or hosted next to the scheduler, reached over gRPC through
discovery/embedded.py) for a self-contained deployment, and Consul (discovery/consul.py) or etcd
(discovery/etcd.py) where a cluster already runs one. Callers pick one with a URL and
`backends.open_registry`, and never see which.

Indexes are opaque integers that only grow. A watch given index 0 answers at once; given the index of
the state the caller has, it answers when that state changed or when its timeout passes (with the same
index, or a new one that may carry no change the caller cares about: callers loop).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from typing import Protocol
from urllib.parse import quote

SERVICE_NAME = "stagemesh-stage"
"""The Consul service name every stage server registers under."""
MAX_VALUE_BYTES = 512 * 1024
"""Consul's limit on a KV value; the embedded registry enforces it too, so nothing works on one backend only."""
MAX_TTL_S = 3600.0
"""The longest lease or heartbeat interval a registration or lock may ask for: a record that registers with a TTL
of 1e9 would outlive its stage for decades, and one that dies keeps its place in every plan."""
MAX_ID_CHARS, MAX_ADDRESS_CHARS, MAX_MODEL_CHARS = 256, 256, 1024
"""A record's fields' bounds: far above any real id, host:port or checkpoint path, far below what fills memory."""
MIN_HOLDER_ID_CHARS = 16
"""A lock's holder_id is its holder's secret (whoever sends it may renew or release the lock): not a short name."""
MAX_WAIT_S = 600.0
"""The longest one watch waits (Consul's own cap is 10 minutes)."""
_META_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class RegistryError(Exception):
    """The registry could not be reached or refused the call; the message says what to check."""


@dataclass
class ServiceRecord:
    """A stage server as the registry knows it. meta values are strings (Consul's service meta is)."""

    service_id: str
    address: str
    """host:port of its gRPC server."""
    model: str
    meta: dict[str, str] = field(default_factory=dict)
    """"layers": "A:B" ("" when unassigned), "dtype", "device", "free_bytes", "budget_bytes", ..."""

    def validate(self) -> None:
        """Raises ValueError on what either backend would reject, so both reject the same records."""
        for name, value, most in (("service_id", self.service_id, MAX_ID_CHARS),
                                  ("address", self.address, MAX_ADDRESS_CHARS), ("model", self.model, MAX_MODEL_CHARS)):
            if len(value) > most:
                raise ValueError(f"{name} is {len(value)} characters; the limit is {most}")
        if not self.service_id or "/" in self.service_id:
            raise ValueError(f"service_id {self.service_id!r}: use a non-empty id without '/'")
        split_address(self.address)
        if not self.model:
            raise ValueError("model must be set")
        if len(self.meta) > 63:
            raise ValueError(f"{len(self.meta)} meta keys: Consul allows 64 including 'model'")
        for key, value in self.meta.items():
            if not _META_KEY.match(key) or key == "model" or key.startswith("consul-"):
                raise ValueError(f"meta key {key!r}: use letters, digits, '_' or '-' (not 'model', not 'consul-*')")
            if not isinstance(value, str) or len(value) > 512:
                raise ValueError(f"meta[{key!r}] must be a string of at most 512 characters")
        if len(self.model) > 512:
            raise ValueError("model must be at most 512 characters (it is stored in service meta)")

    def copy(self) -> ServiceRecord:
        return replace(self, meta=dict(self.meta))


@dataclass
class ServiceStatus:
    record: ServiceRecord
    passing: bool
    """Alive now. False while critical: the registrant stopped heartbeating (or, on Consul, its gRPC
    health endpoint stopped serving); it is removed after its deregister_after_s."""


@dataclass(frozen=True)
class Fence:
    """A write conditioned on holding a lock, checked by the registry itself as it applies the write (an etcd
    transaction on the lock's lease, a Consul transaction checking the lock's session, the embedded registry's
    holder id): a leader whose lease lapsed while it was paused or slow is refused, whatever it believes."""

    lock_key: str
    holder_id: str
    """The holder's secret (acquire_lock's holder_id)."""


@dataclass
class KVEntry:
    key: str
    value: bytes
    modify_index: int
    """The index of the entry's last write: what kv_cas compares with."""


class Registry(Protocol):
    """What stage servers, routers and the scheduler need from a registry. All calls are async;
    errors reaching the backend raise RegistryError, invalid arguments ValueError."""

    async def register(self, record: ServiceRecord, ttl_s: float, deregister_after_s: float | None = None) -> None:
        """Adds or replaces (same service_id) a service, passing now. It must heartbeat() within every ttl_s or
        it turns critical, and is removed after deregister_after_s critical (None: 3 * ttl_s; Consul: >= 60 s)."""
        ...

    async def heartbeat(self, service_id: str) -> bool:
        """Keeps the service passing for another ttl_s. False: the registry does not know it (removed, or
        the registry restarted): register again."""
        ...

    async def deregister(self, service_id: str) -> None:
        """Removes the service now (clean shutdown). An unknown id is not an error."""
        ...

    async def services(self, model: str | None = None) -> list[ServiceStatus]:
        """The services of model (None: all), sorted by service_id."""
        ...

    async def watch_services(self, index: int, timeout_s: float,
                             model: str | None = None) -> tuple[int, list[ServiceStatus]]:
        """Blocks until the services changed (register, deregister, health) after index, or timeout_s
        passes; returns the new index and services(model)."""
        ...

    async def kv_get(self, key: str) -> tuple[bytes | None, int]:
        """(value, modify_index); (None, 0) when the key does not exist."""
        ...

    async def kv_put(self, key: str, value: bytes, fence: Fence | None = None) -> None:
        """Writes the key (the embedded registry: LockHeld for a held lock's key); with a fence, only while its
        holder holds its lock (LockLost otherwise, and nothing is written)."""
        ...

    async def kv_cas(self, key: str, value: bytes, index: int, fence: Fence | None = None) -> bool:
        """Writes only if the key's modify_index is still index (0: only if absent). False: someone wrote
        first; read again and retry. With a fence, LockLost when its holder no longer holds its lock."""
        ...

    async def kv_delete(self, key: str, fence: Fence | None = None) -> None:
        """Deletes the key; a missing key is not an error (the embedded registry: LockHeld for a held lock's
        key; Consul and etcd hold their locks by session and lease, and their ACLs say who may write). With a
        fence, LockLost when its holder no longer holds its lock."""
        ...

    async def kv_list(self, prefix: str) -> list[KVEntry]:
        """Every entry whose key starts with prefix, sorted by key."""
        ...

    async def watch_key(self, key: str, index: int, timeout_s: float) -> tuple[int, KVEntry | None]:
        """Blocks until key changed after index, or timeout_s passes; returns the new index and the entry."""
        ...

    async def watch_prefix(self, prefix: str, index: int, timeout_s: float) -> tuple[int, list[KVEntry]]:
        """Blocks until a key under prefix changed after index, or timeout_s passes; returns kv_list(prefix)."""
        ...

    async def acquire_lock(self, key: str, holder_id: str, ttl_s: float) -> bool:
        """Takes the lock unless another holder has it; True if holder_id holds it now. The key then holds
        holder_name(holder_id); holder_id is the holder's secret (check_holder_id). The holder must renew_lock
        within ttl_s (Consul: >= 10 s, and it may take up to 2 * ttl_s
        to free an abandoned lock); holder_id must be unique per candidate."""
        ...

    async def renew_lock(self, key: str, holder_id: str) -> bool:
        """Extends the lease; False: holder_id lost the lock (expired or released) and must stop leading."""
        ...

    async def release_lock(self, key: str, holder_id: str) -> None:
        """Frees the lock, and deletes its key, if holder_id holds it: another candidate can take it now."""
        ...

    async def lock_holder(self, key: str) -> str | None:
        """The name (holder_name) of the lock's holder, or None when nobody holds it."""
        ...

    async def close(self) -> None:
        """Releases connections and threads (not locks or services: release and deregister first)."""
        ...


# Key layout. Models are often checkpoint paths, so each model is one percent-encoded key segment.

def model_prefix(model: str) -> str:
    """"stagemesh/<model>/": every key of one model."""
    return f"stagemesh/{quote(model, safe='')}/"


def chains_key(model: str) -> str:
    """The pipeline chains routers use, and the placement plan that explains them (chain_table)."""
    return model_prefix(model) + "chains"


def assignments_prefix(model: str) -> str:
    return model_prefix(model) + "assignments/"


def assignment_key(model: str, service_id: str) -> str:
    """The layers the scheduler assigned to one stage server, which watches this key."""
    return assignments_prefix(model) + service_id


def leader_key(model: str) -> str:
    """The scheduler leader lock of a model."""
    return model_prefix(model) + "leader"


def parse_layers(value: str, num_layers: int) -> tuple[int, int]:
    """A layer range as stored in meta and assignments, "A:B" -> (A, B) with 0 <= A < B <= num_layers;
    ValueError otherwise (anyone who reaches the registry can write one)."""
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise ValueError(f"layers {value!r} is not A:B") from None
    if not 0 <= a < b <= num_layers:
        raise ValueError(f"layers {value!r} is outside the model's 0:{num_layers}")
    return a, b


def split_address(address: str) -> tuple[str, int]:
    """"host:port" (or "[v6]:port") -> (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: use host:port with a port in 1..65535")
    return host.strip("[]"), int(port)


def check_key(key: str, value: bytes | None = None) -> None:
    """Raises ValueError on keys or values Consul would reject, for both backends."""
    if not key or key.startswith("/"):
        raise ValueError(f"key {key!r}: use a non-empty key without a leading '/', e.g. {chains_key('m')!r}")
    if value is not None:
        if not isinstance(value, bytes):
            raise ValueError(f"value of {key!r} must be bytes, not {type(value).__name__}")
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"value of {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")


def check_ttl(name: str, seconds: float) -> None:
    if not 0 < seconds <= MAX_TTL_S:
        raise ValueError(f"{name} must be positive seconds, at most {MAX_TTL_S:g}, got {seconds!r}")


def check_holder_id(holder_id: str) -> None:
    """ValueError for a holder_id too short to be a secret (MIN_HOLDER_ID_CHARS)."""
    if not MIN_HOLDER_ID_CHARS <= len(holder_id) <= MAX_ID_CHARS:
        raise ValueError(f"holder_id must be a secret of {MIN_HOLDER_ID_CHARS}..{MAX_ID_CHARS} characters "
                         "(e.g. secrets.token_hex(16)), not a name")


def holder_name(holder_id: str) -> str:
    """The name a lock shows for its holder (its key's value, LockHolder's answer): a digest of the holder_id,
    which tells holders apart and lets a holder recognise itself without handing out the secret."""
    return "holder-" + hashlib.sha256(holder_id.encode()).hexdigest()[:16]


class LockHeld(Exception):
    """A write or delete of a held lock's key by anyone: only its holder changes it (renew, release)."""


class LockLost(Exception):
    """A fenced write or delete refused by the registry: the fence's holder no longer holds its lock (its lease
    lapsed, another candidate may lead now), so it must stop acting."""
