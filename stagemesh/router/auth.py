"""Callers' tokens at the router's front door (`--auth-tokens FILE`): who may call, at which priority,
how often.

The file names each caller and its secret:
    {"tokens": [{"name": "billing", "token": "...", "max_priority": 0, "requests_per_second": 50,
                 "max_concurrent": 8, "max_queued": 32, "tokens_per_minute": 200000, "max_new_tokens": 1024,
                 "cache_group": "finance"}]}
A call must carry the metadata `authorization: Bearer <token>`, else UNAUTHENTICATED; a priority above
the token's max_priority is PERMISSION_DENIED; more calls than its rate (a token bucket per caller,
burst = rate) are RESOURCE_EXHAUSTED. The other limits (CallerLimits) are the admission queue's to hold
(router/priority_queue.py). Each caller's prefix-cache blocks are its own; callers with the same `cache_group`
share theirs (router/cache_scope.py). Health and reflection stay open (probes and grpcurl need them).
The HTTP front (router/http_api.py) holds its calls to the same, through check_call, with the `authorization`
header.

Only SHA-256 digests of the tokens are kept, compared with hmac.compare_digest against every entry, so
the secrets are in no object a log line, a metric or ListChains could show; callers are named by
`name` (CALLER, for log lines). The file is read again by reload() (SIGHUP): new tokens work and
removed ones stop at once, without a restart; a file that does not parse leaves the old tokens in force.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import inspect
import json
import logging
import math
import stat
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from stagemesh import metrics
from stagemesh.errors import Continuation, StatusError
from stagemesh.v1 import router_pb2

log = logging.getLogger("stagemesh.router")

OPEN_SERVICES = frozenset({health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
                           "grpc.reflection.v1.ServerReflection"})
"""Services any caller reaches without a token: load balancers' probes and grpcurl's discovery."""
AUTHORIZATION = "authorization"
MIN_TOKEN_CHARS = 16
"""A shorter secret is guessable; `python -c "import secrets; print(secrets.token_urlsafe(32))"` makes a good one."""


@dataclass(frozen=True)
class CallerLimits:
    """One caller's share of the router, from its entry in the tokens file; None: no limit. Held by the admission
    queue (router/priority_queue.py), which refuses a request past one with RESOURCE_EXHAUSTED naming it."""

    max_concurrent: int | None = None
    """Streams of this caller that may run at once; more wait in the queue (its own, served in turn)."""
    max_queued: int | None = None
    """Requests of this caller that may wait at once; the next one is refused."""
    tokens_per_minute: int | None = None
    """Prompt and new tokens per minute: a request is charged its prompt plus max_new_tokens when it asks (a
    bucket of this size that refills over a minute), and what it did not generate is given back when it ends."""
    max_new_tokens: int | None = None
    """The most new tokens one request of this caller may ask for."""


NO_LIMITS = CallerLimits()
_LIMITS = tuple(f.name for f in dataclasses.fields(CallerLimits))
_FIELDS = {"name", "token", "max_priority", "requests_per_second", "cache_group", *_LIMITS}
CALLER: ContextVar[str] = ContextVar("stagemesh_caller", default="")
"""The name of the caller whose call this task serves ("" without --auth-tokens): for its log lines."""


@dataclass(frozen=True)
class Grant:
    """What one token allows; the token itself only as its digest."""

    name: str
    digest: bytes
    max_priority: int = 0
    requests_per_second: float | None = None
    """None: no rate limit."""
    limits: CallerLimits = NO_LIMITS
    cache_group: str = ""
    """Callers with the same cache_group share their prefix-cache blocks ("": its blocks are its own)."""


GRANT: ContextVar[Grant | None] = ContextVar("stagemesh_grant", default=None)
"""The grant of the caller whose call this task serves (None without --auth-tokens): its limits, for admission."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, source: str) -> list[Grant]:
    """The grants of a token file's text; ValueError naming the entry (never its token) when malformed."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
        raise ValueError(f'{source}: expected {{"tokens": [{{"name": ..., "token": ..., "max_priority": ..., '
                         f'"requests_per_second": ...}}, ...]}}')
    grants: list[Grant] = []
    for i, entry in enumerate(doc["tokens"]):
        where = f"{source}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object")
        if unknown := sorted(set(entry) - _FIELDS):
            raise ValueError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(_FIELDS)}")
        name, token = entry.get("name"), entry.get("token")
        if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable():
            raise ValueError(f"{where}: name must be 1..64 printable characters")
        where = f"{source}: caller {name!r}"
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not (
                token.isascii() and token.isprintable() and " " not in token):
            raise ValueError(f"{where}: token must be at least {MIN_TOKEN_CHARS} printable ASCII characters "
                             "without spaces")
        max_priority = entry.get("max_priority", 0)
        if not isinstance(max_priority, int) or isinstance(max_priority, bool):
            raise ValueError(f"{where}: max_priority must be an integer (0: normal; > 0 lets it ask for high)")
        rate = entry.get("requests_per_second")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                                 or not (math.isfinite(rate) and rate > 0)):
            raise ValueError(f"{where}: requests_per_second must be a number > 0 (leave it out for no limit)")
        group = entry.get("cache_group", "")
        if not isinstance(group, str) or len(group) > 64 or not group.isprintable():
            raise ValueError(f"{where}: cache_group must be at most 64 printable characters (callers naming the "
                             "same one share their prefix-cache blocks)")
        limits = {}
        for field_name in _LIMITS:
            value = entry.get(field_name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}: {field_name} must be an integer >= 1 (leave it out for no limit)")
            limits[field_name] = value
        grants.append(Grant(name, _digest(token), max_priority, None if rate is None else float(rate),
                            CallerLimits(**limits), group))
    names = [g.name for g in grants]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{source}: caller names must be unique: {twice}")
    if len({g.digest for g in grants}) != len(grants):
        raise ValueError(f"{source}: two callers have the same token; give each its own")
    return grants


class TokenBucket:
    """`rate` requests per second on average, at most `capacity` (default max(rate, 1)) at once."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic, capacity: float | None = None):
        self.rate = rate
        self.capacity = max(rate, 1.0) if capacity is None else capacity
        self.clock = clock
        self.level = self.capacity
        self.updated = clock()

    def take(self, cost: float = 1.0) -> bool:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        if self.level < cost:
            return False
        self.level -= cost
        return True

    def give(self, cost: float) -> None:
        """Gives back what a taker did not use (never above capacity)."""
        self.level = min(self.capacity, self.level + cost)


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` metadata entry, if any."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def priorities(request: Any) -> list[int]:
    """The priorities a request asks for: one per prompt (GenerateBatch has many)."""
    if isinstance(request, router_pb2.GenerateRequest):
        return [request.priority]
    if isinstance(request, router_pb2.GenerateBatchRequest):
        return [r.priority for r in request.requests]
    return []


class TokenAuth:
    """The grants of a token file, reloadable, and each caller's bucket."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.clock = clock
        self.grants: list[Grant] = []
        self.buckets: dict[str, TokenBucket] = {}
        self.reload()

    def reload(self) -> list[str]:
        """Reads the file again; returns the callers' names. Tokens no longer listed stop working at once;
        a caller whose rate is unchanged keeps its bucket. ValueError/OSError: the old tokens stay."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"--auth-tokens {self.path}: no such file") from None
        grants = parse_tokens(text, f"--auth-tokens {self.path}")
        if self.path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(f"{self.path} (callers' tokens) is readable by other users than its owner: chmod 600 it")
        buckets = {}
        for g in grants:
            if g.requests_per_second is not None:
                kept = self.buckets.get(g.name)
                buckets[g.name] = kept if kept and kept.rate == g.requests_per_second else TokenBucket(
                    g.requests_per_second, self.clock)
        self.grants, self.buckets = grants, buckets
        return [g.name for g in grants]

    def authenticate(self, metadata: Sequence[tuple[str, Any]] | None) -> Grant:
        """The grant of the call's bearer token; StatusError(UNAUTHENTICATED) without a valid one."""
        token = bearer_token(metadata)
        if token is None:
            raise StatusError(grpc.StatusCode.UNAUTHENTICATED,
                              "this router needs a token: send the metadata 'authorization: Bearer <token>'")
        digest = _digest(token)
        found = None
        for grant in self.grants:  # every entry compared, in constant time each
            if hmac.compare_digest(digest, grant.digest):
                found = grant
        if found is None:
            raise StatusError(grpc.StatusCode.UNAUTHENTICATED, "the token is not valid here (unknown or revoked)")
        return found

    def admit(self, grant: Grant, request: Any) -> Grant:
        """Holds an authenticated call to its grant: priority, then rate (a prompt costs one)."""
        asked = priorities(request)
        if asked and max(asked) > grant.max_priority:
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"priority {max(asked)} is above caller {grant.name!r}'s max_priority "
                              f"{grant.max_priority}: ask with priority <= {grant.max_priority}")
        bucket = self.buckets.get(grant.name)
        cost = max(1, len(asked))
        if bucket is not None and not bucket.take(cost):
            if cost > bucket.capacity:
                raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{cost} prompts in one call are more than caller {grant.name!r}'s "
                                  f"{bucket.rate:g} requests per second allow at once: split the batch")
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"caller {grant.name!r} is over its {bucket.rate:g} requests per second: retry later")
        return grant


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Holds every call but health and reflection to TokenAuth, before the handler runs; sets CALLER.

    The token is checked on the call's metadata, which arrives before its message: a call without a valid one is
    answered by a handler that takes the message as bytes (never parsed) and refuses it, so that a stranger's
    16 MiB body costs the router no parse. Priority and rate need the parsed request and are checked after."""

    def __init__(self, auth: TokenAuth):
        self.auth = auth

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.lstrip("/").split("/")[0] in OPEN_SERVICES:
            return handler
        try:
            grant = self.auth.authenticate(details.invocation_metadata)
        except StatusError as exc:
            return _guarded(handler, self, details.method, exc, parse=False)
        return _guarded(handler, self, details.method, grant)

    async def admit(self, method: str, grant: Grant | StatusError, request: Any,
                    context: grpc.aio.ServicerContext) -> None:
        """Lets the call through with CALLER and GRANT set, or aborts it (always raises then); grant is the
        authentication's outcome (its refusal, for a call without a valid token)."""
        try:
            check_call(self.auth, method, grant, request, context.peer())
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        CALLER.set(grant.name)
        GRANT.set(grant)


def check_call(auth: TokenAuth, method: str, grant: Grant | StatusError, request: Any, peer: str) -> Grant:
    """Both front doors' check of a call (gRPC's interceptor, the HTTP front): the authentication's outcome (its
    refusal raised as it is), then TokenAuth.admit; a refusal is counted (AUTH_REFUSED) and logged with the caller's
    name when its token was valid, then raised as StatusError."""
    try:
        if isinstance(grant, StatusError):
            raise grant
        return auth.admit(grant, request)
    except StatusError as exc:
        caller = "" if isinstance(grant, StatusError) else grant.name
        metrics.AUTH_REFUSED.labels(exc.code.name, caller).inc()
        log.info(f"refused {method}: {exc.code.name}: {exc.message}", extra={"code": exc.code.name,
                                                                              "caller": caller, "peer": peer})
        raise


def _guarded(handler: grpc.RpcMethodHandler, interceptor: AuthInterceptor, method: str,
             grant: Grant | StatusError, parse: bool = True) -> grpc.RpcMethodHandler:
    """The same handler, admitted first; serializers and streaming kinds unchanged, except that a call refused
    already (parse=False) gets its message as bytes, unparsed."""
    serdes = {"request_deserializer": handler.request_deserializer if parse else None,
              "response_serializer": handler.response_serializer}
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    unary_request = bool(handler.unary_unary or handler.unary_stream)

    if inspect.isasyncgenfunction(behavior):
        async def guarded(request_or_iterator, context):
            await interceptor.admit(method, grant, request_or_iterator if unary_request else None, context)
            async with contextlib.aclosing(behavior(request_or_iterator, context)) as responses:
                async for response in responses:
                    yield response
    else:
        async def guarded(request_or_iterator, context):
            await interceptor.admit(method, grant, request_or_iterator if unary_request else None, context)
            return await behavior(request_or_iterator, context)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(guarded, **serdes)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(guarded, **serdes)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(guarded, **serdes)
    return grpc.stream_stream_rpc_method_handler(guarded, **serdes)
