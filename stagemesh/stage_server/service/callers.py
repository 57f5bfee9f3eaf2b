"""Who is calling a stage, as far as its sessions and its prefix cache go: the connection owns what it opens, and
the prefix cache is shared within a trust domain only."""

from __future__ import annotations

import grpc


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, as far as session ownership goes: the caller's connection. A router's channel
    to a stage is one connection, so its OpenSession, Sessions and CloseSession calls share it; a
    session id seen elsewhere (a log, a capture) is of no use from any other connection."""
    return context.peer()


def prefix_domain(context: grpc.aio.ServicerContext) -> str:
    """Who shares the stage's prefix cache: with --tls every mesh member (all present the mesh's certificate),
    else the callers of one host (the peer's address without its port). A block is indexed under the tokens its
    opener named, which the stage cannot check past the first stage: a caller elsewhere must not put KV under
    another caller's prompt."""
    if context.auth_context().get("x509_pem_cert"):
        return "mesh"
    return context.peer().rsplit(":", 1)[0]
