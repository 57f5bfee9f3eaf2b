"""What the router knows of a chain: its stages (their addresses, layers and channels, opened on first use) and
their reported load, and how long a stage may take to answer before it is called hung. A request's session on
a chain is router/session.py's."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import grpc

from stagemesh import grpc_server
from stagemesh.tls import Tls
from stagemesh.v1 import stage_pb2_grpc

log = logging.getLogger("stagemesh.router")


@dataclass
class StageEndpoint:
    address: str
    layer_start: int = 0
    layer_end: int = 0
    tls: Tls | None = field(default=None, repr=False)
    """The mesh identity the channel presents and checks the stage against (None: plaintext)."""
    tp: int = 1  # ranks of its tensor-parallel group, as published (router.chains routes long prompts by it)
    mux: object = field(default=None, repr=False, compare=False)
    """Its Stage/Sessions stream, which every session on it rides (router.session_mux.mux_of)."""
    _stub: stage_pb2_grpc.StageStub | None = field(default=None, repr=False)
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)

    @property
    def stub(self) -> stage_pb2_grpc.StageStub:
        if self._stub is None:
            self._channel = grpc_server.channel(self.address, self.tls)
            self._stub = stage_pb2_grpc.StageStub(self._channel)
        return self._stub

    @property
    def channel(self) -> grpc.aio.Channel:
        self.stub  # noqa: B018 - creates the channel on first use
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


_chain_counter = itertools.count(1)
_closing: set[asyncio.Task] = set()


def background(coro) -> None:
    """Runs coro without waiting for it (a strong reference keeps it alive until done)."""
    task = asyncio.get_running_loop().create_task(coro)
    _closing.add(task)
    task.add_done_callback(_closing.discard)


@dataclass
class Chain:
    """Stages that together cover all layers, in order."""

    stages: list[StageEndpoint]
    chain_id: str = field(default_factory=lambda: f"chain-{next(_chain_counter)}")
    healthy: bool = True
    in_flight: int = 0
    # The load its stages last reported (health checks): steps queued at the busiest, KV bytes free at the fullest.
    queued_steps: int = 0
    kv_free_bytes: int = 0
    step_ms: float = 0.0  # the slowest stage's median decode pass, as reported: the base of step timeouts
    pass_ms: float = 0.0  # its stages' longest recent passes (prefill chunks included), summed, as reported
    max_batch_tokens: int = 0  # the smallest pass budget of its stages, as reported (0: not known yet)
    late_checks: int = 0  # health checks in a row that got no answer in time
    marked_down: int = 0  # times a failure on it marked it down: a check begun before the last one is stale
    fingerprint: str = ""  # what its stages serve (published, then as they report it)
    problem: str = ""  # why its last check found it unusable (in ListChains), "" when it passed
    problem_key: str = ""  # what of it was logged last: each problem is logged once, not at every check
    withdrawn: bool = False  # no longer published: its channels close when its last stream ends
    sessions: set = field(default_factory=set, repr=False, compare=False)
    """Sessions open on it (router.session): marking it down aborts them (ChainSet.mark_down)."""
    answered_at: float = 0.0  # when a step on it last got the last stage's answer (monotonic): traffic got through

    @property
    def label(self) -> str:
        return " -> ".join(f"{s.address}[{s.layer_start}:{s.layer_end}]" for s in self.stages)

    def prefill_chunk(self, wanted: int) -> int:
        """The chunk to send this chain: `wanted` (0: whole prompts), but never more than a pass of its
        stages holds, which would run alone and hold every other session's decoding back."""
        if not self.max_batch_tokens:
            return wanted
        return min(wanted, self.max_batch_tokens) if wanted else self.max_batch_tokens


@dataclass(frozen=True)
class Progress:
    """How long a stage may take to answer before the router calls it hung (SIGSTOP, a stuck
    compute thread, a black-holed link) and moves the stream: scaled by what the stage reports, so
    that a slow model's honest step is never taken for a hang."""

    floor_s: float = 10.0
    """No answer is called late sooner than this."""
    per_token_steps: float = 4.0
    """On top of the floor: this many of the chain's reported decode passes per token in the step, and per step
    queued ahead of it."""
    passes: float = 2.0
    """And this many of the longest pass its stages report (StageInfo.pass_ms: the longest lately, or a full one
    as their warm-up timed it): a decode step that lands behind another caller's prefill chunk waits that pass
    out, and rides in the next."""

    def timeout(self, chain: Chain, tokens: int) -> float:
        return (self.floor_s + self.per_token_steps * chain.step_ms * (tokens + chain.queued_steps) / 1000
                + self.passes * chain.pass_ms / 1000)
