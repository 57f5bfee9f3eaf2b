"""Backpressure: what a stage holds for a peer that sends faster than it is served is bounded, and a full queue
stops the stage reading that peer (HTTP/2 flow control then holds the sender back) instead of growing.

An incoming stream (a router's Sessions stream, a previous stage's Relay link) counts the steps it took off the
wire whose pass has not ended, and the answers queued for it but not yet written; its reader reads nothing more
while that is over --stream-queue-steps or --stream-queue-mb. A link to a next stage counts the hidden states
queued for it and not yet written; a session's next pass waits while that is over --relay-queue-mb, so a next
stage that lags (or stopped) holds back the passes that would feed it, and through them the streams they came on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from stagemesh import metrics
from stagemesh.config_flags import refused
from stagemesh.v1 import stage_pb2

MiB = 1 << 20


@dataclass
class QueueConfig:
    stream_queue_steps: int = 1024
    """An incoming stream (a router's Sessions stream, a previous stage's Relay link) holds at most this many
    steps taken off the wire and not yet run, and answers not yet written: past it the stage reads no more of
    that stream until some are done, and HTTP/2 flow control holds its sender back (a peer that stops reading,
    or sends faster than the stage computes, costs bounded memory)."""
    stream_queue_mb: float = 64.0
    """The same bound in MiB of the steps' inputs (a long prompt's hidden states): whichever is reached first."""
    relay_queue_mb: float = 64.0
    """A link to a next stage holds at most this many MiB of hidden states not yet written to it: past it the
    sessions' passes that go there wait (and the streams that feed them stop being read) until the next stage
    takes some, so a lagging or stopped next stage costs bounded memory here."""

    def __post_init__(self) -> None:
        if not self.stream_queue_steps >= 1:
            raise refused(self, "stream_queue_steps", "must be >= 1 step")
        if not self.stream_queue_mb > 0:
            raise refused(self, "stream_queue_mb", "must be > 0 MiB")
        if not self.relay_queue_mb > 0:
            raise refused(self, "relay_queue_mb", "must be > 0 MiB")


def step_bytes(request: stage_pb2.ForwardRequest) -> int:
    """About what a step's input holds (its tensor's shape and dtype: reading its bytes would copy them)."""
    tensor = request.hidden if request.HasField("hidden") else request.token_ids
    n = 4 if tensor.dtype in ("float32", "int32") else 8 if tensor.dtype == "int64" else 2
    for d in tensor.shape:
        n *= max(d, 0)
    return n + 64


class Budget:
    """What one queue holds: items and bytes taken and not yet given back; `room()` waits while either is at its
    limit. One item larger than the byte limit still passes (alone)."""

    def __init__(self, max_items: int, max_bytes: int, what: str):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items = self.bytes = 0
        self.what = what
        self.waiting = 0
        """Tasks waiting for room now."""
        self._room = asyncio.Event()
        self._room.set()

    @property
    def full(self) -> bool:
        return self.items >= self.max_items or self.bytes >= self.max_bytes

    def take(self, nbytes: int = 0, items: int = 1) -> None:
        self.items += items
        self.bytes += nbytes
        if self.full:
            self._room.clear()

    def give(self, nbytes: int = 0, items: int = 1) -> None:
        self.items -= items
        self.bytes -= nbytes
        if not self.full:
            self._room.set()

    def release(self) -> None:
        """Nothing will be given back (the queue's peer is gone): whoever waits goes on."""
        self.max_items = self.max_bytes = 1 << 62
        self._room.set()

    async def room(self) -> None:
        """Returns at once while there is room; else waits (counted: stagemesh_queue_full_waits_total)."""
        if not self._room.is_set():
            metrics.QUEUE_FULL_WAITS.labels(self.what).inc()
            self.waiting += 1
            try:
                while not self._room.is_set():
                    await self._room.wait()
            finally:
                self.waiting -= 1


def stream_budget(config: QueueConfig) -> Budget:
    return Budget(config.stream_queue_steps, int(config.stream_queue_mb * MiB), "stream")


def link_budget(config: QueueConfig) -> Budget:
    return Budget(1 << 62, int(config.relay_queue_mb * MiB), "link")
