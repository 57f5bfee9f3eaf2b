"""How another service calls stagemesh: generated stubs, a streaming Generate, a deadline and metadata.

    python scripts/generate_client.py --router 127.0.0.1:50051 "Once upon a time"
    # a router with --tls DIR and --auth-tokens FILE:
    STAGEMESH_TOKEN=... python scripts/generate_client.py --router HOST:50051 --ca DIR/ca.pem "Once upon a time"
"""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

import grpc

from stagemesh.v1 import router_pb2, router_pb2_grpc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prompt")
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--deadline", type=float, default=30.0, help="seconds for the whole call")
    p.add_argument("--ca", help="TLS: the CA file the router's certificate is checked against")
    p.add_argument("--cert", help="TLS: this caller's certificate (PEM), for a router with --client-ca")
    p.add_argument("--key", help="TLS: the key of --cert")
    a = p.parse_args()
    token = os.environ.get("STAGEMESH_TOKEN")  # from the environment, not argv: `ps` shows argv to everyone
    metadata = [("x-caller", "example"), *([("authorization", f"Bearer {token}")] if token else [])]

    if a.ca or a.cert:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(a.ca).read_bytes() if a.ca else None,
            private_key=Path(a.key).read_bytes() if a.key else None,
            certificate_chain=Path(a.cert).read_bytes() if a.cert else None)
        channel = grpc.secure_channel(a.router, credentials)
    else:
        channel = grpc.insecure_channel(a.router)
    with channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            prompt=a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
            request_id=uuid.uuid4().hex[:16],
        )
        try:
            for response in stub.Generate(request, timeout=a.deadline, metadata=metadata):
                print(response.text, end="", flush=True)
                if response.finish_reason:
                    print(f"\n[{router_pb2.FinishReason.Name(response.finish_reason)}, "
                          f"request {response.request_id}]")
        except grpc.RpcError as err:
            raise SystemExit(f"generate failed: {err.code().name}: {err.details()}") from None


if __name__ == "__main__":
    main()
