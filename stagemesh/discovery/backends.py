"""Opens a registry backend from its URL: the one place that knows every backend."""

from __future__ import annotations

import importlib
import ipaddress
import os
from dataclasses import dataclass
from types import ModuleType

import grpc

from stagemesh.discovery.embedded import EmbeddedRegistryClient
from stagemesh.discovery.registry import Registry, split_address
from stagemesh.tls import Tls

CONSUL_PORTS = {"consul": 8500, "consul+https": 8501}
"""Consul's own defaults: its HTTP API on 8500, its HTTPS API on 8501."""
ETCD_SCHEMES = ("etcd", "etcd+https")
ETCD_PORT = 2379
"""etcd's own default client port."""
URL_FORMS = ("use local://HOST:PORT, HOST:PORT, consul://HOST:PORT, consul+https://HOST:PORT, "
             "etcd://HOST:PORT[,HOST:PORT...] or etcd+https://HOST:PORT[,HOST:PORT...]")


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


@dataclass(frozen=True)
class EtcdTarget:
    """How to reach an etcd cluster, from the URL, the --tls directory and etcdctl's own environment."""

    target: str
    """A gRPC target naming every member: "ipv4:H:P,H:P" for addresses, "dns:///NAME:P" for one name."""
    address: str
    """The members as the URL gave them, for messages."""
    tls: bool = False
    ca: bytes | None = None
    """https: the CA that signed the members' certificates (None: the system's CAs)."""
    cert: tuple[bytes, bytes] | None = None
    """https: the client certificate and key presented (a cluster with --client-cert-auth wants one)."""
    server_name: str | None = None
    """https over several addresses: the name checked in the members' certificates (the first host)."""
    user: tuple[str, str] | None = None
    """(name, password) for a cluster with auth enabled."""

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        key, cert = (self.cert[1], self.cert[0]) if self.cert else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=key, certificate_chain=cert)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def etcd_target(url: str, tls: Tls | None = None, env: dict[str, str] | None = None) -> EtcdTarget:
    """etcd://H:P[,H:P...] (plaintext) or etcd+https://H:P[,H:P...] (TLS, verified against ETCDCTL_CACERT,
    else the --tls directory's ca.pem, else the system's CAs; presenting ETCDCTL_CERT and ETCDCTL_KEY, else
    the mesh certificate of --tls). Hosts are the members' client addresses (port 2379 if left out): IP
    addresses, or one DNS name that resolves to every member. Credentials: ETCDCTL_USER ("name:password",
    or the name with ETCDCTL_PASSWORD), as etcdctl takes them."""
    env = os.environ if env is None else env
    scheme, _, rest = url.partition("://")
    if scheme not in ETCD_SCHEMES or not rest or "/" in rest:
        raise ValueError(f"registry URL {url!r}: {URL_FORMS}")
    members = []
    for part in rest.split(","):
        host, port = split_address(part) if ":" in part else (part, ETCD_PORT)
        if not host:
            raise ValueError(f"registry URL {url!r}: {URL_FORMS}")
        members.append((host, port))
    try:
        ips = [ipaddress.ip_address(host) for host, _ in members]
    except ValueError:
        if len(members) > 1:
            raise ValueError(f"registry URL {url!r}: name several members by IP address, or give one DNS name "
                             f"that resolves to all of them") from None
        ips = []
    if ips and len({ip.version for ip in ips}) > 1:
        raise ValueError(f"registry URL {url!r}: give the members as all IPv4 or all IPv6 addresses")
    if ips:
        target = f"ipv{ips[0].version}:" + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in members)
    else:
        target = f"dns:///{members[0][0]}:{members[0][1]}"
    user = None
    if env.get("ETCDCTL_USER"):
        name, sep, password = env["ETCDCTL_USER"].partition(":")
        user = (name, password if sep else env.get("ETCDCTL_PASSWORD", ""))
    if scheme == "etcd":
        return EtcdTarget(target, rest, user=user)
    ca = _read(env["ETCDCTL_CACERT"]) if env.get("ETCDCTL_CACERT") else (tls.ca if tls else None)
    if bool(env.get("ETCDCTL_CERT")) != bool(env.get("ETCDCTL_KEY")):
        raise ValueError("set both ETCDCTL_CERT and ETCDCTL_KEY, or neither")
    cert = ((_read(env["ETCDCTL_CERT"]), _read(env["ETCDCTL_KEY"])) if env.get("ETCDCTL_CERT")
            else (tls.cert, tls.key) if tls else None)
    return EtcdTarget(target, rest, True, ca, cert, members[0][0] if ips else None, user)


def plaintext_hosts(url: str | None) -> tuple[str, ...]:
    """The addresses a registry URL dials that are plaintext unless --tls covers them: the embedded registry's
    (mutual TLS with --tls), Consul's or etcd's without +https. None, "local" (this process hosts it) and the
    +https schemes (TLS of their own) dial none."""
    if not url or url == "local":
        return ()
    scheme, sep, rest = url.partition("://")
    if sep and scheme not in ("local", "consul", "etcd"):
        return ()
    return tuple(rest.split(","))


def backend(name: str, extra: str) -> ModuleType:
    """stagemesh.discovery.<name>, whose client library is the `extra` extra (imported only where its registry is
    used, so that a router or stage on the embedded registry needs neither etcd's nor Consul's client)."""
    try:
        return importlib.import_module(f"stagemesh.discovery.{name}")
    except ImportError as exc:
        raise ValueError(f"the {name} registry needs {exc.name}, which is not installed: "
                         f"pip install 'stagemesh[{extra}]'") from None


def open_registry(url: str, tls: Tls | None = None) -> Registry:
    """local://HOST:PORT or HOST:PORT: the embedded registry the scheduler serves there (over gRPC; mutual
    TLS with tls). consul://HOST[:PORT] or consul+https://HOST[:PORT]: a Consul agent (see consul_target);
    with tls, the stages' Consul health checks use TLS too. etcd://H:P[,H:P...] or etcd+https://...: an etcd
    cluster (see etcd_target)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "local", url
    if scheme == "local":
        split_address(rest)
        return EmbeddedRegistryClient(rest, tls=tls)
    if scheme in CONSUL_PORTS:
        target = consul_target(url, tls)
        consul = backend("consul", "consul")
        return consul.ConsulRegistry(target.host, target.port, token=target.token, scheme=target.scheme,
                                     verify=target.verify, cert=target.cert, grpc_check_tls=tls is not None)
    if scheme in ETCD_SCHEMES:
        target = etcd_target(url, tls)
        etcd = backend("etcd", "etcd")
        return etcd.EtcdRegistry(target.target, credentials=target.credentials(), server_name=target.server_name,
                                 user=target.user, address=target.address)
    raise ValueError(f"registry URL {url!r}: {URL_FORMS}")
