"""Forwarding: a session's route through the chain (where its output goes, what it was told once at
open), and the stage's links to its next stages: one long-lived Relay stream per neighbour, carrying
the steps of every session forwarded there, created on first use and again after it breaks.

A link that breaks fails every session it carried that is still open here, naming the next stage: a
step lost on the way would otherwise leave the router waiting for a token that never comes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import grpc

from stagemesh import grpc_server, metrics
from stagemesh.errors import StatusError
from stagemesh.stage_server.engine.sampling import Sampling
from stagemesh.stage_server.service.backpressure import Budget, QueueConfig, link_budget
from stagemesh.tls import Tls, refuse_plaintext
from stagemesh.v1 import stage_pb2

log = logging.getLogger("stagemesh.stage")

@dataclass
class Route:
    """What a session was told at open (stage.proto OpenSessionRequest), and where its router hears
    from it: the Sessions stream that opened it."""

    next_address: str = ""
    """Where output hidden states go ("": nowhere; a last stage answers its token to the router)."""
    next_key: str = field(default="", repr=False)
    upstream_key: str = field(default="", repr=False)
    sampling: Sampling | None = None
    wire_dtype: str = ""
    previous_address: str = ""
    repairable: bool = False
    """A broken link (or a next stage that no longer holds the session) does not end the session here: its
    router repairs the chain (Reroute) or closes it."""
    feed: asyncio.Queue | None = field(default=None, repr=False)
    """The router's stream: results (ForwardResponse) and the session's fault (an exception) go here."""
    held: list = field(default_factory=list, repr=False)
    """What came before the router's stream was attached."""
    order: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Relayed steps run one at a time, in the order they came (asyncio's lock is first come, first served)."""
    pending: int = 0
    """The session's steps and reroutes taken off the wire whose tasks (in_order) have not ended."""
    stepped: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set when a step of the session ran (or it closed): what a waiting Reroute (stage.proto's wait) waits on."""

    def in_order(self, work: Coroutine, running: set[asyncio.Task]) -> None:
        """Runs work, which takes `order` first, on a task of its own (kept in running while it runs)."""
        self.pending += 1
        task = asyncio.get_running_loop().create_task(work)
        running.add(task)
        task.add_done_callback(running.discard)
        task.add_done_callback(self._ended)

    def _ended(self, _task: asyncio.Task) -> None:
        self.pending -= 1

    @property
    def forwards(self) -> bool:
        return bool(self.next_address)

    def attach(self, feed: asyncio.Queue) -> None:
        if self.feed is feed:
            return
        self.feed = feed
        for item in self.held:
            feed.put_nowait(item)
        self.held.clear()

    def deliver(self, item: object) -> None:
        """A result or the fault, to the router's stream (held until one is attached)."""
        if self.feed is None:
            self.held.append(item)
        else:
            self.feed.put_nowait(item)


LinkBroken = Callable[[str, set[str], grpc.StatusCode, str], None]
"""(next address, sessions it carried, code, details): what the stage does when a link breaks."""
Refused = Callable[[str, stage_pb2.RelayStatus], None]
"""(next address, the next stage's answer): a relayed step it did not take."""


CLOSED = "the link was closed (this stage stopped or swapped its slice)"
RELAY_METHOD = f"/{stage_pb2.DESCRIPTOR.services_by_name['Stage'].full_name}/Relay"
RELAY_BATCH_BYTES = 1 << 20
"""A Relay message holds queued steps up to this size (one larger step goes alone): well inside the next
stage's receive limit, a whole pass's hidden states plus 1 MiB."""


def relay_call(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    """A Stage/Relay call whose serializer counts the bytes it writes (the message is encoded once: ByteSize()
    would encode it again, ~75 µs per MiB)."""
    wire_out = metrics.WIRE_BYTES.labels("out")

    def serialize(batch: stage_pb2.RelayBatch) -> bytes:
        data = batch.SerializeToString()
        wire_out.inc(len(data))
        return data

    return channel.stream_stream(RELAY_METHOD, request_serializer=serialize,
                                 response_deserializer=stage_pb2.RelayStatus.FromString)()


class Link:
    """One Relay stream to a next stage; `sessions` are those it carries (each dropped when it closes here).
    `queued` counts the bytes of steps not yet written (room() waits while it is over --relay-queue-mb).

    The link's own writer task does every write, in the order sent: a session's task only queues its step.
    A write is never cancelled with the task of the session it carries (the session's router ended its stream,
    the stream it came on ended): grpc.aio cancels the whole call when a write is cancelled, and that ended the
    link for every session of every chain on it (issue 12's mid-roll failure)."""

    def __init__(self, address: str, channel: grpc.aio.Channel, on_broken: LinkBroken, on_refused: Refused,
                 queued: Budget):
        self.address = address
        self.queued = queued
        self.call = relay_call(channel)
        self.sessions: set[str] = set()
        self.broken = False
        self.why = ""
        """Why this stage ended the link ("": it did not, the call ended on its own)."""
        self._outbox: deque[stage_pb2.RelayBatch] = deque()  # messages to write, the last one still open
        self._bytes: deque[int] = deque()  # about what each message of the outbox holds
        self._queued = asyncio.Event()
        self._on_broken = on_broken
        self._on_refused = on_refused
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write(), name=f"relay-to-{address}")
        self._reader = loop.create_task(self._read(), name=f"relay-from-{address}")

    def step(self, session_id: str, nbytes: int) -> stage_pb2.ForwardRequest:
        """A new step for the next stage, made in place in the link's next message (appending a built message
        would copy it: ~1 ms per MiB): fill it in before awaiting anything. nbytes, about what it will hold,
        keeps one message under RELAY_BATCH_BYTES. A link that breaks before it is written fails its session."""
        self.sessions.add(session_id)
        if not self._outbox or (self._bytes[-1] + nbytes > RELAY_BATCH_BYTES and self._outbox[-1].steps):
            self._outbox.append(stage_pb2.RelayBatch())
            self._bytes.append(0)
        self._bytes[-1] += nbytes
        self.queued.take(nbytes, items=0)
        self._queued.set()
        return self._outbox[-1].steps.add(session_id=session_id)

    async def _write(self) -> None:
        while True:
            await self._queued.wait()
            self._queued.clear()
            # Every step queued since the last write goes in one message (a pass's outputs are queued together):
            # a gRPC message costs both stages' event loops about as much for one step as for thirty.
            while self._outbox:
                batch = self._outbox.popleft()
                try:
                    await self.call.write(batch)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                    self.end(f"a write failed ({type(exc).__name__})")  # the reader sees the end, fails what it carried
                    return
                finally:
                    del batch  # not held while the next write waits on the next stage
                self.queued.give(self._bytes.popleft(), items=0)

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the link ended"
        try:
            async for status in self.call:
                self._on_refused(self.address, status)
            details = "it ended the link"
        except grpc.aio.AioRpcError as exc:
            details = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:  # this stage cancelled the call (self.why says why), or the task
            details = self.why or "the link was closed"
            raise
        finally:
            self.broken = True
            self._writer.cancel()
            self.queued.release()  # nothing queued will be written: the passes waiting for room go on (and fail)
            log.log(logging.INFO if self.why == CLOSED else logging.WARNING,
                    f"link to the next stage {self.address} ended: {details} ({len(self.sessions)} session(s) it "
                    f"carried, {sum(len(b.steps) for b in self._outbox)} step(s) unsent)")
            self._on_broken(self.address, self.sessions, code, details)

    def end(self, why: str) -> None:
        """Ends the link from this side (the reader then fails what it carried)."""
        self.why = self.why or why
        self.call.cancel()

    def close(self) -> None:
        self.end(CLOSED)
        self._writer.cancel()
        self._reader.cancel()


class Links:
    """The stage's links to its next stages, by address: channels with the stage's mesh TLS."""

    def __init__(self, tls: Tls | None, on_broken: LinkBroken, on_refused: Refused, insecure: bool = False,
                 queues: QueueConfig | None = None):
        self.tls = tls
        self.queues = queues or QueueConfig()
        self.insecure = insecure  # --insecure: plaintext to next stages off loopback too
        self.on_broken = on_broken
        self.on_refused = on_refused
        self.links: dict[str, Link] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}

    def check(self, address: str) -> None:
        """StatusError where a router names a next stage off loopback that this plaintext stage may not dial:
        the hidden states and hop keys would cross the network in the clear (the start-up refusal's rule)."""
        try:
            refuse_plaintext(self.tls is not None, self.insecure, dials=(address,))
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"next_address: this stage {exc}") from None

    def link(self, address: str) -> Link:
        link = self.links.get(address)
        if link is None or link.broken:
            channel = self.channels.get(address)
            if channel is None:
                channel = self.channels[address] = grpc_server.channel(address, self.tls)
            link = self.links[address] = Link(address, channel, self.on_broken, self.on_refused,
                                              link_budget(self.queues))
        return link

    async def room(self, address: str) -> None:
        """Waits while the link to address holds --relay-queue-mb of unwritten steps (its next stage lags)."""
        await self.link(address).queued.room()

    def has_room(self, address: str) -> bool:
        link = self.links.get(address)
        return link is None or link.broken or not link.queued.full

    def step(self, address: str, session_id: str, nbytes: int) -> stage_pb2.ForwardRequest:
        """Link.step on the link to address."""
        return self.link(address).step(session_id, nbytes)

    def forget(self, session_id: str) -> None:
        """A session closed here: no link carries it any more (a link that breaks later fails only open ones)."""
        for link in self.links.values():
            link.sessions.discard(session_id)

    @property
    def sessions(self) -> int:
        """Sessions the links carry now (Stage/Info link_sessions)."""
        return sum(len(link.sessions) for link in self.links.values())

    @property
    def queued_bytes(self) -> int:
        return sum(link.queued.bytes for link in self.links.values() if not link.broken)

    async def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        for channel in self.channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self.channels.clear()
