"""Opens a registry backend from its URL: the one place that knows every backend."""

from __future__ import annotations

import os

from stagemesh.discovery.consul import ConsulRegistry
from stagemesh.discovery.embedded import EmbeddedRegistryClient
from stagemesh.discovery.registry import Registry, split_address


def open_registry(url: str) -> Registry:
    """local://HOST:PORT or HOST:PORT: the embedded registry the scheduler serves there (over gRPC).
    consul://HOST[:PORT]: a Consul agent (port 8500 by default), with the token in CONSUL_HTTP_TOKEN."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "local", url
    if scheme == "local":
        split_address(rest)
        return EmbeddedRegistryClient(rest)
    if scheme == "consul":
        host, port = split_address(rest) if ":" in rest else (rest, 8500)
        if host:
            return ConsulRegistry(host, port, token=os.environ.get("CONSUL_HTTP_TOKEN") or None)
    raise ValueError(f"registry URL {url!r}: use local://HOST:PORT, HOST:PORT or consul://HOST:PORT")
