"""Whose prefix cache a request reads and fills: the caller's own, never another tenant's.

Every block key a stage computes for a request starts from the request's prefix salt (kv_pool.prefix_keys), and the
router puts the caller's scope at the root of that salt: a block one caller's request left is found only by the
same caller's requests, so `cached_tokens` (and time to first token) tells a caller nothing about anyone else's
prompts. The scope is, in this order: the tokens file's `cache_group` of the caller's token (callers of one group
share their blocks), its token's name, the certificate the caller presented on the public port (mTLS), or for a
caller with neither, its host (anonymous callers on loopback share one scope). A request's `cache_salt` narrows
it further: blocks are shared only between that caller's requests with the same salt. Stages see a digest of the
scope, never the caller's name.
"""

from __future__ import annotations

import hashlib

import grpc

from stagemesh.errors import StatusError
from stagemesh.router.auth import Grant
from stagemesh.tls import host_of, is_loopback

MAX_CACHE_SALT_BYTES = 256
"""vLLM's cache_salt is a short opaque string; anything longer is a mistake (or an attempt to make the router hash)."""
ANONYMOUS_LOOPBACK = "anonymous:loopback"


def peer_identity(host: str, certificate: bytes | None = None) -> str:
    """Who a caller without a token is: the certificate it presented (its digest), else its host (the peer's address
    without its port; every loopback address is one host)."""
    if certificate:
        return "cert:" + hashlib.sha256(certificate).hexdigest()
    return ANONYMOUS_LOOPBACK if is_loopback(host) else "anonymous:" + host


def grpc_peer_identity(context: grpc.aio.ServicerContext) -> str:
    """peer_identity of a gRPC caller: its client certificate (--client-ca), else the host of context.peer()
    ("ipv4:10.0.0.5:40001", "ipv6:[::1]:5000")."""
    certs = context.auth_context().get("x509_pem_cert")
    peer = context.peer().partition(":")[2]
    return peer_identity(host_of(peer) if peer else "", certs[0] if certs else None)


def caller_identity(grant: Grant | None, peer: str) -> str:
    """The scope of a caller's blocks before any cache_salt: its token's cache_group, else its token's name, else
    peer (peer_identity)."""
    if grant is None:
        return peer
    return f"group:{grant.cache_group}" if grant.cache_group else f"caller:{grant.name}"


def cache_scope(identity: str, cache_salt: str) -> str:
    """What the router puts at the root of every block key of a request (a digest: stages see no caller's name);
    INVALID_ARGUMENT for a cache_salt over MAX_CACHE_SALT_BYTES."""
    salt = cache_salt.encode()
    if len(salt) > MAX_CACHE_SALT_BYTES:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"cache_salt has {len(salt)} bytes; at most {MAX_CACHE_SALT_BYTES} are accepted")
    digest = hashlib.blake2b(identity.encode(), digest_size=16)
    digest.update(b"\0" + salt)
    return digest.hexdigest()
