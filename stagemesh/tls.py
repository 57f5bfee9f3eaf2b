"""Mutual TLS between stagemesh's components: one private CA, one mesh certificate every component
presents as server and as client (`stagemesh certs` makes them; stagemesh/certs.py).

A `--tls DIR` names a directory holding ca.pem, mesh.pem and mesh-key.pem, or the same three under the names a
Kubernetes TLS secret (cert-manager's) mounts them with: ca.crt, tls.crt and tls.key. It is read once, when a
server or client starts, and checked here (files present, the certificate issued by the CA, the key
its own, not expired), so that a wrong directory stops the process with a message instead of every
handshake failing later without one.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

log = logging.getLogger("stagemesh.tls")

CA_FILE = "ca.pem"
"""The CA every component trusts: a peer is one of ours if its certificate was issued by it."""
CERT_FILE = "mesh.pem"
"""The certificate every component presents, as server and as client."""
KEY_FILE = "mesh-key.pem"
"""mesh.pem's private key: readable by its owner only."""
SECRET_FILES = ("ca.crt", "tls.crt", "tls.key")
"""The same three as a kubernetes.io/tls secret (cert-manager's) holds them: CA, certificate, key."""
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


@dataclass(frozen=True)
class Tls:
    """A --tls directory, read and checked: what servers present and require, and what clients present."""

    directory: Path
    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    @property
    def ca_path(self) -> Path:
        """The CA on disk, for clients that take a path (requests, for Consul)."""
        return self.directory / (CA_FILE if (self.directory / CA_FILE).is_file() else SECRET_FILES[0])

    @property
    def cert_path(self) -> Path:
        """mesh.pem on disk (tls.crt in a Kubernetes secret), for servers that take a path (the HTTP front)."""
        return self.directory / (CERT_FILE if (self.directory / CA_FILE).is_file() else SECRET_FILES[1])

    @property
    def key_path(self) -> Path:
        """mesh-key.pem on disk (tls.key in a Kubernetes secret)."""
        return self.directory / (KEY_FILE if (self.directory / CA_FILE).is_file() else SECRET_FILES[2])

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serves with the mesh certificate and refuses any client without a certificate from the CA."""
        return server_credentials(self.cert, self.key, client_ca=self.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trusts only servers with a certificate from the CA, and presents the mesh certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


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


def load(directory: str | Path | None) -> Tls | None:
    """The --tls directory, checked; None (plaintext) when no directory is given."""
    if directory is None:
        return None
    root = Path(directory)
    names = (CA_FILE, CERT_FILE, KEY_FILE)
    if not (root / CA_FILE).is_file() and all((root / name).is_file() for name in SECRET_FILES):
        names = SECRET_FILES  # a Kubernetes TLS secret, mounted as it is
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--tls {root}: {', '.join(missing)} missing there; make the files with "
                                f"`stagemesh certs {root}` (and copy ca.pem, mesh.pem, mesh-key.pem to every host), or "
                                f"mount a Kubernetes TLS secret there ({', '.join(SECRET_FILES)})")
    ca, cert, key = (root / name for name in names)
    tls = Tls(root, ca.read_bytes(), cert.read_bytes(), key.read_bytes())
    check(tls)
    if key.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(f"{key} is readable by other users than its owner: chmod 600 it")
    return tls


def check(tls: Tls) -> None:
    """ValueError when the files do not make a working mesh identity."""
    where = f"--tls {tls.directory}"
    try:
        ca = x509.load_pem_x509_certificate(tls.ca)
        cert = x509.load_pem_x509_certificate(tls.cert)
        key = serialization.load_pem_private_key(tls.key, password=None)
    except ValueError as exc:
        raise ValueError(f"{where}: not PEM certificates and an unencrypted PEM key ({exc})") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError(f"{where}: {CERT_FILE} was not issued by {CA_FILE}; make both with `stagemesh certs`, "
                         "or put the CA that issued it in ca.pem") from None
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise ValueError(f"{where}: {KEY_FILE} is not the key of {CERT_FILE}")
    now = datetime.datetime.now(datetime.UTC)
    for name, c in ((CA_FILE, ca), (CERT_FILE, cert)):
        if not c.not_valid_before_utc <= now <= c.not_valid_after_utc:
            raise ValueError(f"{where}: {name} is valid from {c.not_valid_before_utc:%Y-%m-%d} to "
                             f"{c.not_valid_after_utc:%Y-%m-%d}, not now; make new ones with `stagemesh certs`")
