"""The chains the scheduler publishes in the registry (`stagemesh/<model>/chains`), as JSON.

Routers read this; it is the only thing they need from the scheduler."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PublishedStage:
    service_id: str
    address: str
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class PublishedChain:
    stages: tuple[PublishedStage, ...]
    chain_id: str = field(default="")

    def __post_init__(self) -> None:
        if not self.chain_id:
            # Same stages, same id: routers keep their counters and channels across re-publications.
            digest = hashlib.sha1(
                "|".join(f"{s.address}:{s.layer_start}:{s.layer_end}" for s in self.stages).encode()
            ).hexdigest()[:10]
            object.__setattr__(self, "chain_id", f"chain-{digest}")

    @property
    def label(self) -> str:
        return " -> ".join(f"{s.address}[{s.layer_start}:{s.layer_end}]" for s in self.stages)


def encode_chains(chains: list[PublishedChain]) -> bytes:
    return json.dumps({"chains": [asdict(c) for c in chains]}, sort_keys=True).encode()


def decode_chains(raw: bytes | None) -> list[PublishedChain]:
    if not raw:
        return []
    data = json.loads(raw)
    return [
        PublishedChain(tuple(PublishedStage(**s) for s in c["stages"]), c["chain_id"]) for c in data["chains"]
    ]
