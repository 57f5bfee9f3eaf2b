"""Who may call what, from the role its mesh certificate names (stagemesh://role/<role>, stagemesh/certs.py).

Each TLS server installs one RoleInterceptor with its services' policies (ServicePolicy): a method held to a role
answers PERMISSION_DENIED, naming the role it needs and the one the caller presented, to a certificate without that
role; the methods a policy leaves open (Info, reads) and other services (health, reflection) take every holder of a
certificate from the mesh CA, as the handshake already requires. A policy is closed by default: a method not listed
is held to its default role. A certificate naming no role (the mesh.pem of earlier versions) is every role. The role
is read from the peer's certificate in gRPC's auth context, which the CA-checked handshake filled: a caller cannot
claim it."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509

from stagemesh.errors import Continuation
from stagemesh.tls import ROLES, roles_of, san_values

EVERY_ROLE = frozenset(ROLES)
"""What a role-less certificate is."""
PEM_CERT_PROPERTY = "x509_pem_cert"
"""gRPC's auth context property holding the peer's certificate."""


@dataclass(frozen=True)
class Peer:
    """A caller's identity, from its certificate."""

    roles: frozenset[str]
    hosts: tuple[str, ...]
    """The DNS names and IP addresses its certificate names."""
    role_less: bool

    def presented(self) -> str:
        if self.role_less:
            return "a certificate naming no role (every role)"
        return f"role {', '.join(sorted(self.roles))}"


@functools.lru_cache(maxsize=512)
def _parse(pem: bytes) -> Peer:
    cert = x509.load_pem_x509_certificate(pem)
    roles = roles_of(cert)
    hosts = (*san_values(cert, x509.DNSName), *(str(ip) for ip in san_values(cert, x509.IPAddress)))
    return Peer(roles or EVERY_ROLE, hosts, not roles)


def peer_of(context: grpc.aio.ServicerContext) -> Peer | None:
    """The caller's identity; None on a plaintext server (no certificate to read)."""
    pems = context.auth_context().get(PEM_CERT_PROPERTY)
    return _parse(pems[0]) if pems else None


async def require(context: grpc.aio.ServicerContext, method: str, allowed: frozenset[str]) -> Peer | None:
    """Aborts with PERMISSION_DENIED unless the caller's certificate names one of allowed; returns its identity."""
    peer = peer_of(context)
    if peer is not None and not peer.roles & allowed:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{method} takes calls from a {' or '.join(sorted(allowed))} certificate; the caller "
                            f"presented {peer.presented()}")
    return peer


def names_host(peer: Peer | None, host: str) -> bool:
    """Whether a caller's certificate names host (an IP address or DNS name; `*.` entries match one label); a
    plaintext caller or a role-less certificate names every host."""
    if peer is None or peer.role_less:
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    for name in peer.hosts:
        if address is not None:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(name) == address:
                    return True
        elif fnmatch.fnmatchcase(host.lower(), name.lower()) and host.count(".") == name.count("."):
            return True
    return False


@dataclass(frozen=True)
class ServicePolicy:
    """Who may call one service's methods: those in `methods` the role named there (None: any certificate from the
    CA: reads), every other method `default`. Closed by default: a method added to the service later is held to
    `default` until it is listed."""

    service: str
    """The full service name, e.g. stagemesh.v1.Registry."""
    default: str
    methods: Mapping[str, str | None]

    def allowed(self, method: str) -> frozenset[str]:
        """The roles that may call method (its name alone); empty: any certificate from the CA."""
        role = self.methods.get(method, self.default)
        return frozenset([role]) if role else frozenset()


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Holds each method of the services in policy to its roles, before its handler sees a message; installed only
    on TLS servers."""

    def __init__(self, *policies: ServicePolicy):
        self.policies = {f"/{p.service}": p for p in policies}

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        service, _, name = details.method.rpartition("/")
        policy = self.policies.get(service)
        allowed = policy.allowed(name) if policy is not None else frozenset()
        if handler is None or not allowed:
            return handler
        method = details.method.lstrip("/")
        return _checked(handler, lambda context: require(context, method, allowed))


def _checked(handler: grpc.RpcMethodHandler, check: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    """The same handler, its behavior run only after check(context) passed."""
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            await check(context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
    else:
        async def wrapped(request, context):
            await check(context)
            return await behavior(request, context)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(wrapped, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
