"""A small typed client of the router, for Python callers: plain values in and out, the stubs underneath. Needs
only the base install (grpcio and the stubs; no torch).

    from stagemesh.client import Client

    with Client("127.0.0.1:50051") as client:
        for piece in client.generate("Once upon a time", max_new_tokens=32):
            print(piece.text, end="", flush=True)
        print(client.chains())

A failed call raises grpc.RpcError with the router's status and message (docs/calling.md lists them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from stagemesh.v1 import router_pb2, router_pb2_grpc


@dataclass(frozen=True)
class Piece:
    """One message of a stream: the tokens made since the previous one, their text, and on the last message why
    the stream ended ("length", "stop" or "eos"; "" before the last)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    request_id: str


@dataclass(frozen=True)
class ModelInfo:
    """What the router serves (GetModelInfo)."""

    model: str
    context_length: int
    vocab_size: int
    fingerprint: str
    chat_template: bool
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChainInfo:
    chain_id: str
    healthy: bool
    stages: tuple[str, ...]


FINISH = {router_pb2.FINISH_REASON_LENGTH: "length", router_pb2.FINISH_REASON_STOP: "stop",
          router_pb2.FINISH_REASON_EOS: "eos"}


class Client:
    """A connection to one router. token: a caller token of the router's --auth-tokens file (default
    $STAGEMESH_TOKEN); ca / cert / key: PEM files for a router serving TLS (its CA, and this caller's certificate
    where the router asks for one)."""

    def __init__(self, address: str, *, token: str | None = None, ca: str | Path | None = None,
                 cert: str | Path | None = None, key: str | Path | None = None, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        token = token if token is not None else os.environ.get("STAGEMESH_TOKEN")
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if ca or cert:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(ca).read_bytes() if ca else None,
                private_key=Path(key).read_bytes() if key else None,
                certificate_chain=Path(cert).read_bytes() if cert else None)
            self.channel = grpc.secure_channel(address, credentials)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (), priority: int = 0,
                 request_id: str = "", ignore_eos: bool = False, min_tokens: int = 0,
                 timeout_s: float | None = None) -> Iterator[Piece]:
        """Streams the generation of `prompt` (text, or token ids) piece by piece; the deadline covers the whole
        stream. Leaving the loop early cancels the request (its sessions close on every stage). ignore_eos and
        min_tokens let the model's end-of-sequence token end nothing (before min_tokens new tokens)."""
        request = router_pb2.GenerateRequest(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=list(stop), priority=priority, request_id=request_id, ignore_eos=ignore_eos,
            min_tokens=min_tokens)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.token_ids.extend(prompt)
        call = self.stub.Generate(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        try:
            for r in call:
                yield Piece(tuple(r.token_ids), r.text, FINISH.get(r.finish_reason, ""), r.request_id)
        finally:
            call.cancel()  # a no-op once the stream has ended

    def complete(self, prompt: str | Sequence[int], **options) -> tuple[list[int], str, str]:
        """The whole generation at once: (token ids, text, finish reason)."""
        ids, text, reason = [], "", ""
        for piece in self.generate(prompt, **options):
            ids.extend(piece.token_ids)
            text += piece.text
            reason = piece.finish_reason or reason
        return ids, text, reason

    def chains(self) -> list[ChainInfo]:
        """The router's chains and whether each is healthy now."""
        listed = self.stub.ListChains(router_pb2.ListChainsRequest(), timeout=self.timeout_s, metadata=self.metadata)
        return [ChainInfo(c.chain_id, c.healthy, tuple(s.address for s in c.stages)) for c in listed.chains]

    def model_info(self) -> ModelInfo:
        """What the router serves: its model's name, context, vocabulary size and end-of-sequence ids."""
        info = self.stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=self.timeout_s,
                                      metadata=self.metadata)
        return ModelInfo(info.model, info.context_length, info.vocab_size, info.fingerprint, info.chat_template,
                         tuple(info.eos_token_ids))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
