"""The chains the scheduler publishes in the registry (`stagemesh/<model>/chains`), as JSON, with the plan that
explains them.

Routers read this; it is the only thing they need from the scheduler. The plan travels in the same value so that
no reader sees a plan announce chains the table lacks, or chains the plan does not explain."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from stagemesh.discovery.registry import split_address


@dataclass(frozen=True)
class PublishedStage:
    service_id: str
    address: str
    layer_start: int
    layer_end: int
    tp: int = 1
    """Ranks of its tensor-parallel group, all on one host (1: not tensor-parallel; absent from older tables)."""
    host: str = ""
    """The machine it runs on (its --host-id), "" when not announced."""


def chain_kind(tps: list[int]) -> str:
    """What a chain of stages with these tensor-parallel sizes is: "replica" (one stage of one rank), "tp" (one
    stage of several ranks) or "pipeline" (several stages)."""
    return "pipeline" if len(tps) > 1 else "tp" if tps and tps[0] > 1 else "replica"


def tp_width(tps: list[int]) -> int:
    """A chain's tensor-parallel width: its narrowest stage's (the rest of a prefill waits on that stage)."""
    return min(tps, default=1)


@dataclass(frozen=True)
class PublishedChain:
    stages: tuple[PublishedStage, ...]
    chain_id: str = field(default="")
    fingerprint: str = ""
    """What every stage of it serves (checkpoint.serving_fingerprint); "" from schedulers before it."""

    def __post_init__(self) -> None:
        if not self.chain_id:
            # Same stages and build, same id: routers keep their counters and channels across
            # re-publications; another build on the same addresses is another chain.
            digest = hashlib.sha1(
                "|".join([self.fingerprint, *(f"{s.address}:{s.layer_start}:{s.layer_end}" for s in self.stages)])
                .encode()).hexdigest()[:10]
            object.__setattr__(self, "chain_id", f"chain-{digest}")

    @property
    def label(self) -> str:
        return " -> ".join(f"{s.address}[{s.layer_start}:{s.layer_end}]" + f" tp {s.tp}" * (s.tp > 1)
                           for s in self.stages)

    @property
    def kind(self) -> str:
        return chain_kind([s.tp for s in self.stages])

    @property
    def tp_width(self) -> int:
        return tp_width([s.tp for s in self.stages])


def encode_chains(chains: list[PublishedChain], plan: str = "") -> bytes:
    return json.dumps({"chains": [asdict(c) for c in chains], "plan": plan}, sort_keys=True).encode()


def decode_chains(raw: bytes | None) -> list[PublishedChain]:
    """The published chains; ValueError, saying what is wrong, for anything but a well-formed table
    (anyone who reaches the registry can write this key)."""
    if not raw:
        return []
    try:
        data = json.loads(raw)
        chains = [_chain(c) for c in data["chains"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed chain table ({type(exc).__name__}: {exc})") from None
    return chains


def published_plan(raw: bytes | None) -> str | None:
    """The plan published with the chains; None where nothing was published, "" from schedulers before it
    (or for a table that is not one: decode_chains says what is wrong with it)."""
    if raw is None:
        return None
    try:
        plan = json.loads(raw).get("plan", "")
    except (ValueError, AttributeError):
        return ""
    return plan if isinstance(plan, str) else ""


def _chain(c: dict) -> PublishedChain:
    stages = tuple(_stage(s) for s in c["stages"])
    if not stages or stages[0].layer_start != 0 or any(
            a.layer_end != b.layer_start for a, b in zip(stages, stages[1:], strict=False)):
        raise ValueError(f"chain {c.get('chain_id')!r}: its stages do not cover contiguous layers from 0")
    if not isinstance(c["chain_id"], str) or not isinstance(c.get("fingerprint", ""), str):
        raise ValueError("chain_id and fingerprint must be strings")
    return PublishedChain(stages, c["chain_id"], c.get("fingerprint", ""))


def _stage(s: dict) -> PublishedStage:
    stage = PublishedStage(service_id=s["service_id"], address=s["address"], layer_start=s["layer_start"],
                           layer_end=s["layer_end"], tp=s.get("tp", 1), host=s.get("host", ""))
    if not (isinstance(stage.service_id, str) and isinstance(stage.address, str) and isinstance(stage.host, str)
            and type(stage.layer_start) is int and type(stage.layer_end) is int and type(stage.tp) is int
            and 0 <= stage.layer_start < stage.layer_end and stage.tp >= 1):
        raise ValueError(f"stage {s!r}: service_id, address and host strings, 0 <= layer_start < layer_end "
                         "integers, tp an integer >= 1")
    split_address(stage.address)
    return stage
