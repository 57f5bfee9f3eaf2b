"""Opens a registry backend from its URL: the one place that knows every backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

from stagemesh.discovery.consul import ConsulRegistry
from stagemesh.discovery.embedded import EmbeddedRegistryClient
from stagemesh.discovery.registry import Registry, split_address
from stagemesh.tls import Tls

CONSUL_PORTS = {"consul": 8500, "consul+https": 8501}
"""Consul's own defaults: its HTTP API on 8500, its HTTPS API on 8501."""
URL_FORMS = "use local://HOST:PORT, HOST:PORT, consul://HOST:PORT or consul+https://HOST:PORT"


@dataclass(frozen=True)
class ConsulTarget:
    """How to reach a Consul agent, from the URL, the --tls directory and Consul's own environment."""

    host: str
    port: int
    scheme: str = "http"
    verify: bool | str = True
    """https: the CA file that signed the agent's certificate (True: the system's CAs)."""
    cert: tuple[str, str] | None = None
    """https: a client certificate and key, for an agent with verify_incoming."""
    token: str | None = None
    """The ACL token (CONSUL_HTTP_TOKEN)."""


def consul_target(url: str, tls: Tls | None = None, env: dict[str, str] | None = None) -> ConsulTarget:
    """consul://HOST[:PORT] (HTTP) or consul+https://HOST[:PORT] (HTTPS, verified against CONSUL_CACERT, else
    the --tls directory's ca.pem, else the system's CAs; a client certificate from CONSUL_CLIENT_CERT and
    CONSUL_CLIENT_KEY); the ACL token from CONSUL_HTTP_TOKEN."""
    env = os.environ if env is None else env
    scheme, _, rest = url.partition("://")
    if scheme not in CONSUL_PORTS or not rest or "/" in rest:
        raise ValueError(f"registry URL {url!r}: {URL_FORMS}")
    host, port = split_address(rest) if ":" in rest else (rest, CONSUL_PORTS[scheme])
    if not host:
        raise ValueError(f"registry URL {url!r}: {URL_FORMS}")
    token = env.get("CONSUL_HTTP_TOKEN") or None
    if scheme == "consul":
        return ConsulTarget(host, port, token=token)
    verify: bool | str = env.get("CONSUL_CACERT") or (str(tls.ca_path) if tls else True)
    cert = None
    if env.get("CONSUL_CLIENT_CERT") or env.get("CONSUL_CLIENT_KEY"):
        if not (env.get("CONSUL_CLIENT_CERT") and env.get("CONSUL_CLIENT_KEY")):
            raise ValueError("set both CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY, or neither")
        cert = (env["CONSUL_CLIENT_CERT"], env["CONSUL_CLIENT_KEY"])
    return ConsulTarget(host, port, "https", verify, cert, token)


def open_registry(url: str, tls: Tls | None = None) -> Registry:
    """local://HOST:PORT or HOST:PORT: the embedded registry the scheduler serves there (over gRPC; mutual
    TLS with tls). consul://HOST[:PORT] or consul+https://HOST[:PORT]: a Consul agent (see consul_target);
    with tls, the stages' Consul health checks use TLS too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "local", url
    if scheme == "local":
        split_address(rest)
        return EmbeddedRegistryClient(rest, tls=tls)
    if scheme in CONSUL_PORTS:
        target = consul_target(url, tls)
        return ConsulRegistry(target.host, target.port, token=target.token, scheme=target.scheme,
                              verify=target.verify, cert=target.cert, grpc_check_tls=tls is not None)
    raise ValueError(f"registry URL {url!r}: {URL_FORMS}")
