"""Mutual TLS between stagemesh's components: one private CA, and one certificate per role (router, stage,
scheduler, and client for operators' tools), each naming its role (`stagemesh certs` makes them; stagemesh/certs.py;
stagemesh/roles.py checks them on every call).

A `--tls DIR` names a directory holding ca.pem and the component's <role>.pem and <role>-key.pem; or, as before
roles, one mesh.pem and mesh-key.pem that every component presents (a certificate naming no role is every role:
accepted, with a warning at start); or the same three under the names a Kubernetes TLS secret (cert-manager's) mounts
them with: ca.crt, tls.crt and tls.key. It is checked when read (files present, the certificate issued by the CA, the
key its own, not expired), so that a wrong directory stops the process with a message instead of every handshake
failing later without one; SIGHUP reads it again (Tls.reload), for new handshakes and new channels.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from stagemesh import metrics

log = logging.getLogger("stagemesh.tls")

CA_FILE = "ca.pem"
"""The CA every component trusts: a peer is one of ours if its certificate was issued by it."""
CERT_FILE = "mesh.pem"
"""The certificate every component presents, as server and as client."""
KEY_FILE = "mesh-key.pem"
"""mesh.pem's private key: readable by its owner only."""
SECRET_FILES = ("ca.crt", "tls.crt", "tls.key")
"""The same three as a kubernetes.io/tls secret (cert-manager's) holds them: CA, certificate, key."""
ROLES = ("router", "stage", "scheduler", "client")
"""What `stagemesh certs` issues a certificate for: the three components, and operators' tools (reads only)."""
ROLE_URI = "stagemesh://role/"
"""A certificate names its role as the URI subjectAltName stagemesh://role/<role>."""
CA_KEY_FILE = "ca-key.pem"
"""The CA's private key, kept where `stagemesh certs` ran (it issues new mesh certificates); no host needs it."""


INSECURE_FLAG = "--insecure"
"""Lets a component serve or dial plaintext off loopback (a trial, or a network that encrypts for it)."""


def host_of(address: str) -> str:
    """The host of "HOST", "HOST:PORT", "[V6]:PORT" or a bare IPv6 address."""
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.rpartition(":")[0] if address.count(":") == 1 else address


def is_loopback(address: str) -> bool:
    """Whether address (a host, with or without a port) is this machine's loopback: 127.0.0.0/8, ::1, localhost.
    A wildcard (0.0.0.0, ::) is not: it listens on every interface."""
    host = host_of(address)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class PlaintextConfig:
    """The one --insecure knob, nested in every component's config (one definition, one flag)."""

    insecure: bool = False
    """Serve and dial plaintext off loopback without --tls, which is refused otherwise: for a trial, or a network
    that encrypts and authenticates for us (a service mesh). Loopback (127.0.0.1, ::1, localhost) needs neither."""

    def refuse(self, tls_dir: str | None, listens: tuple[str, ...] = (), dials: tuple[str, ...] = (),
               bearer_tokens: bool = False) -> None:
        """refuse_plaintext with this --insecure."""
        refuse_plaintext(bool(tls_dir), self.insecure, listens, dials, bearer_tokens)


def refuse_plaintext(secured: bool, insecure: bool, listens: tuple[str, ...] = (),
                     dials: tuple[str, ...] = (), bearer_tokens: bool = False) -> None:
    """ValueError when a component without TLS (secured: --tls, or --public-cert for a router's port) would serve
    (listens) or dial (dials) plaintext off loopback, unless --insecure: anyone on its network could then call it
    past the router, or read the hidden states, hop keys and (bearer_tokens: --auth-tokens) callers' tokens in the
    clear. Loopback stays plaintext, as it is
    for `make run` and the tests."""
    if secured or insecure:
        return
    for what, addresses in (("serve on", listens), ("dial", dials)):
        for address in addresses:
            if not is_loopback(address):
                tokens = " and take --auth-tokens bearer tokens" if bearer_tokens and what == "serve on" else ""
                raise ValueError(f"would {what} {address}{tokens} in plaintext, off loopback: give --tls DIR (make "
                                 f"one with `stagemesh certs DIR --hosts ...`), or {INSECURE_FLAG} where the "
                                 "network itself is trusted or encrypted (a service mesh)")


class Tls:
    """A --tls directory, read and checked: what servers present and require, and what clients present.

    Mutable on purpose: reload() (SIGHUP) swaps the certificate and key in place, so every holder's next channel
    presents the new one, and a server made with server_credentials() hands it to its next handshake (connections
    already up keep theirs)."""

    def __init__(self, directory: Path, role: str | None, names: tuple[str, str, str]):
        self.directory = directory
        self.role = role
        """The role this component asked for (None: an operator's tool, which takes client.pem)."""
        self._names = names
        self.ca = self.cert = self.key = b""
        self.roles: frozenset[str] = frozenset()
        """The roles its certificate names (ROLE_URI); empty: a role-less mesh certificate, every role."""
        self.not_after = datetime.datetime.min.replace(tzinfo=datetime.UTC)
        self._read()

    def __repr__(self) -> str:
        return f"Tls({self.directory}, {self.cert_path.name})"

    @property
    def ca_path(self) -> Path:
        """The CA on disk, for clients that take a path (requests, for Consul)."""
        return self.directory / self._names[0]

    @property
    def cert_path(self) -> Path:
        """The certificate on disk (<role>.pem, mesh.pem, or tls.crt in a Kubernetes secret)."""
        return self.directory / self._names[1]

    @property
    def key_path(self) -> Path:
        """Its key on disk."""
        return self.directory / self._names[2]

    def _read(self) -> None:
        """Reads and checks the three files, then swaps them in (all three, or none on an error)."""
        ca, cert, key = (self.directory / name for name in self._names)
        ca_pem, cert_pem, key_pem = ca.read_bytes(), cert.read_bytes(), key.read_bytes()
        parsed = check(self.directory, ca_pem, cert_pem, key_pem, self._names)
        roles = roles_of(parsed)
        if self.role is not None and roles and self.role not in roles:
            raise ValueError(f"--tls {self.directory}: {cert.name} names the role(s) {', '.join(sorted(roles))}, "
                             f"not {self.role}; give this component its own certificate ({self.role}.pem)")
        if key.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(f"{key} is readable by other users than its owner: chmod 600 it")
        self.ca, self.cert, self.key, self.roles = ca_pem, cert_pem, key_pem, roles
        self.not_after = parsed.not_valid_after_utc
        metrics.TLS_CERT_EXPIRY.labels(self.role or "client").set(self.not_after.timestamp())

    def reload(self) -> bool:
        """Reads the files again (SIGHUP); on an error (logged) the certificate in force stays."""
        try:
            self._read()
        except (ValueError, OSError) as exc:
            log.error(f"TLS certificate not reloaded, the one in force stays: {exc}")
            return False
        log.info(f"TLS certificate reloaded from {self.cert_path}: valid until {self.not_after:%Y-%m-%d %H:%M} UTC")
        return True

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serves this certificate, reloaded ones included, and refuses any client without one from the CA."""
        return ServedCredentials(lambda: (self.cert, self.key, self.ca)).credentials()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trusts only servers with a certificate from the CA, and presents this certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


class ServedCredentials:
    """Server credentials that follow what `current` returns (cert, key, client CA or None): each new handshake asks
    (gRPC's certificate config fetcher) and gets the pair in force, so a reload needs no restart and drops no
    connection. The client CA's presence is fixed at the start (gRPC fixes whether a client certificate is
    required)."""

    def __init__(self, current: Callable[[], tuple[bytes, bytes, bytes | None]]):
        self._current = current
        self._given = current()

    def _config(self, given: tuple[bytes, bytes, bytes | None]) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = given
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        now = self._current()
        if now == self._given:
            return None  # unchanged: gRPC keeps the configuration it has
        self._given = now
        return self._config(now)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config(self._given), self._fetch,
                                                   require_client_authentication=self._given[2] is not None)


def server_credentials(cert: bytes, key: bytes, client_ca: bytes | None) -> grpc.ServerCredentials:
    """TLS with cert/key; with client_ca, a client must present a certificate issued by it."""
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def read_file(path: str | Path, what: str) -> bytes:
    """A credential file's bytes, or an error that says which file and which flag."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path}: is a directory, not a PEM file") from None


def role_files(role: str) -> tuple[str, str, str]:
    """ca.pem, <role>.pem, <role>-key.pem: what `stagemesh certs` writes for one role."""
    return CA_FILE, f"{role}.pem", f"{role}-key.pem"


def load(directory: str | Path | None, role: str | None = None) -> Tls | None:
    """The --tls directory, checked; None (plaintext) when no directory is given. role: the component's (router,
    stage, scheduler; None: an operator's tool, client): its <role>.pem, else a role-less mesh.pem (every role,
    with a warning), else a Kubernetes TLS secret's tls.crt."""
    if directory is None:
        return None
    root = Path(directory)
    candidates = [role_files(role or "client"), (CA_FILE, CERT_FILE, KEY_FILE), SECRET_FILES]
    names = next((c for c in candidates if all((root / name).is_file() for name in c)), None)
    if names is None:
        wanted = ", ".join(role_files(role or "client"))
        raise FileNotFoundError(f"--tls {root}: {wanted} missing there (nor ca.pem, mesh.pem, mesh-key.pem); make "
                                f"the files with `stagemesh certs {root}` (and copy ca.pem and each host's role "
                                f"certificate and key there), or mount a Kubernetes TLS secret there "
                                f"({', '.join(SECRET_FILES)})")
    tls = Tls(root, role, names)
    if not tls.roles and role is not None:
        log.warning(f"--tls {root}: {names[1]} names no role, so it is every role (router, stage, scheduler): any "
                    "holder of it may open sessions, publish chains and register stages; issue one certificate per "
                    "role with `stagemesh certs`")
    return tls


def roles_of(cert: x509.Certificate) -> frozenset[str]:
    """The roles a certificate names (URI SANs stagemesh://role/<role>); empty: none (a role-less mesh.pem)."""
    return frozenset(uri.removeprefix(ROLE_URI) for uri in san_values(cert, x509.UniformResourceIdentifier)
                     if uri.startswith(ROLE_URI))


def san_values(cert: x509.Certificate, kind: type) -> list:
    """The subjectAltName entries of one kind (x509.DNSName, x509.IPAddress, ...); [] without the extension."""
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(kind)
    except x509.ExtensionNotFound:
        return []


def is_key_of(key, cert: x509.Certificate) -> bool:
    """Whether key (a private key) is the key of cert: a mismatched pair would fail every handshake."""
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(serialization.Encoding.DER, spki) == \
        cert.public_key().public_bytes(serialization.Encoding.DER, spki)


def certificate_pair(cert_path: str | Path, key_path: str | Path, what: str) -> tuple[bytes, bytes, x509.Certificate]:
    """A certificate (chain) and its key, read and checked to belong together (what: the flag, for the error)."""
    cert_pem, key_pem = read_file(cert_path, what), read_file(key_path, f"{what}'s key")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise ValueError(f"{what} {cert_path}: not a PEM certificate with an unencrypted PEM key ({exc})") from None
    if not is_key_of(key, cert):
        raise ValueError(f"{what}: {key_path} is not the key of {cert_path}")
    return cert_pem, key_pem, cert


def check(directory: Path, ca_pem: bytes, cert_pem: bytes, key_pem: bytes,
          names: tuple[str, str, str]) -> x509.Certificate:
    """The certificate, parsed; ValueError when the files do not make a working identity."""
    where = f"--tls {directory}"
    ca_file, cert_file, key_file = names
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise ValueError(f"{where}: not PEM certificates and an unencrypted PEM key ({exc})") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError(f"{where}: {cert_file} was not issued by {ca_file}; make both with `stagemesh certs`, "
                         f"or put the CA that issued it in {ca_file}") from None
    if not is_key_of(key, cert):
        raise ValueError(f"{where}: {key_file} is not the key of {cert_file}")
    now = datetime.datetime.now(datetime.UTC)
    for name, c in ((ca_file, ca), (cert_file, cert)):
        if not c.not_valid_before_utc <= now <= c.not_valid_after_utc:
            raise ValueError(f"{where}: {name} is valid from {c.not_valid_before_utc:%Y-%m-%d} to "
                             f"{c.not_valid_after_utc:%Y-%m-%d}, not now; make new ones with `stagemesh certs`")
    return cert
