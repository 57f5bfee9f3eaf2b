"""`stagemesh registry`: where the embedded registry serves on its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from stagemesh.config_flags import PORT_RULE, refused
from stagemesh.tls import PlaintextConfig
from stagemesh.tracing import TracingConfig


@dataclass
class RegistryConfig:
    host: str = "127.0.0.1"
    """The address to serve on."""
    port: int = 50050
    """The port stages, routers and schedulers reach it on (local://HOST:PORT); 0 picks a free port."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    tls: str | None = None
    """A directory with ca.pem, scheduler.pem and scheduler-key.pem (`stagemesh certs`; or a role-less mesh.pem):
    serve mutual TLS, so that only holders of a certificate from that CA reach the registry, and only schedulers
    write its keys and only stages their records; reloaded on SIGHUP (default: plaintext)."""
    plaintext: PlaintextConfig = field(default_factory=PlaintextConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise refused(self, "port", PORT_RULE)
        self.plaintext.refuse(self.tls, listens=(self.host,))
