"""A grpc.health.v1 check for Kubernetes exec probes, for where the kubelet's own `grpc:` probe cannot go: with
`--tls`, stagemesh's servers hold mutual TLS and refuse a caller without a certificate from the mesh CA, and the
kubelet presents none (its probe speaks plaintext, or TLS without a client certificate).

    python3 health_probe.py --port 50061 --service stagemesh.v1.Stage --tls /etc/stagemesh/tls   # readiness
    python3 health_probe.py --port 50061 --tls /etc/stagemesh/tls --answers                      # liveness

Exit status: 0 healthy (the service SERVING; with --answers, any answer at all), 1 answered but not SERVING (or the
service unknown), 2 no answer (refused, a failed handshake, the timeout). It dials 127.0.0.1 and, with --tls,
checks the server's certificate for --server-name: by default the first name in mesh.pem that is no wildcard
(every component presents the same mesh certificate, so it names a name the server's certificate holds).
Needs only grpcio, grpcio-health-checking and cryptography, which stagemesh installs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTHY, NOT_SERVING, NO_ANSWER = 0, 1, 2


def first_name(cert_pem: bytes) -> str | None:
    """The first DNS name or IP address in the certificate's subjectAltName that is no wildcard."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = [*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))]
    return next((name for name in found if "*" not in name), None)


def channel(address: str, tls_dir: str | None, server_name: str | None) -> grpc.Channel:
    if tls_dir is None:
        return grpc.insecure_channel(address)
    root = Path(tls_dir)
    cert = (root / "mesh.pem").read_bytes()
    credentials = grpc.ssl_channel_credentials(root_certificates=(root / "ca.pem").read_bytes(),
                                               private_key=(root / "mesh-key.pem").read_bytes(),
                                               certificate_chain=cert)
    name = server_name or first_name(cert)
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(port: int, service: str, tls_dir: str | None, server_name: str | None, answers: bool,
          timeout_s: float) -> tuple[int, str]:
    """(exit status, what was seen)."""
    with channel(f"127.0.0.1:{port}", tls_dir, server_name) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:  # an answer: the server lives, the service is not its
                return (HEALTHY if answers else NOT_SERVING), f"service {service!r} unknown to the server"
            return NO_ANSWER, f"no answer: {code.name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return (HEALTHY if serving or answers else NOT_SERVING), status


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="the server's gRPC port on this pod")
    p.add_argument("--service", default="", help='the service to ask about ("": the server as a whole)')
    p.add_argument("--tls", help="a directory with ca.pem, mesh.pem and mesh-key.pem (default: plaintext)")
    p.add_argument("--server-name", help="the name to check the server's certificate for")
    p.add_argument("--answers", action="store_true",
                   help="healthy if the server answers at all, SERVING or not (a liveness check)")
    p.add_argument("--timeout-s", type=float, default=3.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    status, seen = check(args.port, args.service, args.tls, args.server_name, args.answers, args.timeout_s)
    print(seen, file=sys.stdout if status == HEALTHY else sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
