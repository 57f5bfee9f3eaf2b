"""`stagemesh certs DIR`: a private CA and one certificate per role, for `--tls DIR` on every component.

Each certificate names its role as a URI subjectAltName, stagemesh://role/<role> (router, stage, scheduler,
client): it is signed with the rest of the certificate, a certificate may carry several, and it is where
workload identities live (SPIFFE's URIs); its common name, stagemesh-<role>, is the user etcd's
--client-cert-auth maps it to. Every certificate is usable as server and as client certificate and names every
host name and address that peers dial (DNS/IP subjectAltNames): a stage certificate that names fewer hosts (issue it
with --roles stage --out DIR2 --hosts H) may register only stages at those hosts. Keys are ECDSA P-256, written
readable by their owner only. Run again to reissue: a CA already in DIR is kept, so hosts that trust its ca.pem
accept the new certificates (send the components SIGHUP to take them). `--roles mesh` issues the role-less mesh.pem
of earlier versions (every role).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stagemesh.config_flags import METAVAR, POSITIONAL, TYPE, refused
from stagemesh.tls import CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE, ROLE_URI, ROLES, role_files

CA_DAYS = 3650
"""The CA outlives many mesh certificates: reissuing one must not mean redistributing ca.pem."""
_DNS_NAME = re.compile(r"^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*$")


def parse_hosts(text: str) -> list[str]:
    """'H1,H2,...' -> names and addresses, each a DNS name (`*.` allowed first) or an IP address."""
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise ValueError("give at least one host name or address, e.g. 10.0.0.5,stage-1.internal")
    for host in hosts:
        if not (_is_ip(host) or _DNS_NAME.match(host)):
            raise ValueError(f"{host!r} is neither an IP address nor a DNS name")
    return hosts


def parse_roles(text: str) -> list[str]:
    """'R1,R2' -> roles, each one of ROLES or mesh."""
    roles = [r.strip() for r in text.split(",") if r.strip()]
    for role in roles:
        if role not in (*ROLES, "mesh"):
            raise ValueError(f"role {role!r}: use {', '.join(ROLES)} or mesh (one role-less certificate)")
    return roles


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass
class CertsConfig:
    """`stagemesh certs`: where to write the CA and the role certificates, and whom they name."""

    directory: str = field(metadata={POSITIONAL: True, METAVAR: "DIR"})
    """Where to write ca.pem, <role>.pem and <role>-key.pem (what a host's --tls DIR holds: ca.pem and its roles'
    files) and ca-key.pem (keep it here, off the hosts); a CA already there is kept and only the certificates are
    reissued."""
    hosts: list[str] = field(default_factory=lambda: ["127.0.0.1", "localhost"],
                             metadata={TYPE: parse_hosts, METAVAR: "H1,H2,..."})
    """Every host name and IP address peers dial (routers dial stages by the address they announce;
    everyone dials the registry by its URL), comma-separated; default 127.0.0.1,localhost."""
    days: int = 365
    """How many days the certificates are valid (the CA: ten years)."""
    roles: list[str] = field(default_factory=lambda: list(ROLES), metadata={TYPE: parse_roles, METAVAR: "R1,R2,..."})
    """Which certificates to issue, comma-separated: router, stage, scheduler, client (operators' tools: reads
    only), or mesh (one role-less certificate, every role, as before roles); default: the four roles."""
    out: str | None = None
    """Write the certificates (and a copy of ca.pem) here instead of DIR, e.g. one host's stage certificate naming
    only that host; the CA stays in DIR."""

    def __post_init__(self) -> None:
        if not self.days >= 1:
            raise refused(self, "days", "must be >= 1 day")
        for role in self.roles:
            parse_roles(role)
        for host in self.hosts:  # built directly, not from the flag
            parse_hosts(host)


def _write(path: Path, data: bytes, private: bool) -> None:
    """Writes data; a private file is created (and kept) readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600 if private else 0o644)
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "stagemesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("stagemesh CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_cert(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, hosts: list[str], days: int,
              now: datetime.datetime, role: str = "mesh") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A role's certificate (mesh: the role-less one): server and client auth, naming `hosts` and its role."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h)
                                     for h in hosts]
    if role != "mesh":
        names.append(x509.UniformResourceIdentifier(ROLE_URI + role))
    cert = (x509.CertificateBuilder().subject_name(_name(f"stagemesh-{role}" if role != "mesh" else "stagemesh mesh"))
            .issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), ca.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def make_certs(config: CertsConfig) -> Path:
    """Writes the CA (unless DIR has one) into DIR and new role certificates into --out (default DIR); returns
    where the certificates went."""
    root = Path(config.directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    if (root / CA_FILE).exists() and (root / CA_KEY_FILE).exists():
        ca = x509.load_pem_x509_certificate((root / CA_FILE).read_bytes())
        ca_key = serialization.load_pem_private_key((root / CA_KEY_FILE).read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{root / CA_KEY_FILE}: not an ECDSA key made by `stagemesh certs`")
    elif (root / CA_FILE).exists():
        raise ValueError(f"{root} has {CA_FILE} but not {CA_KEY_FILE}, so no certificate can be issued from it: "
                         "run this where the CA was made, or in an empty directory for a new CA")
    else:
        ca, ca_key = make_ca(now)
        _write(root / CA_KEY_FILE, _key_pem(ca_key), private=True)
        _write(root / CA_FILE, ca.public_bytes(serialization.Encoding.PEM), private=False)
    out = Path(config.out) if config.out else root
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    if out != root:
        _write(out / CA_FILE, (root / CA_FILE).read_bytes(), private=False)
    for role in config.roles:
        cert, key = make_cert(ca, ca_key, config.hosts, config.days, now, role)
        _, cert_file, key_file = (CA_FILE, CERT_FILE, KEY_FILE) if role == "mesh" else role_files(role)
        _write(out / key_file, _key_pem(key), private=True)
        _write(out / cert_file, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return out


def run_certs(config: CertsConfig) -> None:
    out = make_certs(config)
    files = ", ".join(f"{role}.pem" for role in config.roles)
    print(f"wrote {out / CA_FILE} and {files} with their keys (for {', '.join(config.hosts)}, {config.days} days); "
          f"the CA key is {Path(config.directory) / CA_KEY_FILE}\n"
          f"copy ca.pem and each component's <role>.pem and <role>-key.pem to its host and pass --tls DIR there "
          f"(operators' tools take client.pem); keep {CA_KEY_FILE} off the hosts", flush=True)
