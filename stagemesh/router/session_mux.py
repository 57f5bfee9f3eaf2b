"""The router's one Stage/Sessions stream per stage: every session it runs there, its opens,
steps and closes batched into one message per turn of the event loop, and the stage's answers (opened,
tokens, faults) handed to each session's inbox. A request costs no call of its own on any stage.

Sessions only queue: the mux's own writer task does every write. grpc.aio cancels a whole call when a
write() is cancelled, and a session's task is cancelled whenever its request ends (done, failover, caller
gone); written from there, one session's end would end the stream for every session on it."""

from __future__ import annotations

import asyncio
import logging
from array import array

import grpc

from stagemesh import grpc_server
from stagemesh.router.chain_client import StageEndpoint
from stagemesh.router.stage_faults import call_status, stage_error
from stagemesh.v1 import stage_pb2

log = logging.getLogger("stagemesh.router")

BATCH_BYTES = 1 << 20
"""A message holds about this much at most; more waits for the next (far under any stage's limit)."""

CLOSE_WAIT_S = 0.05
"""Closes ride the next message written anyway, or go on their own after this long: a close answers
nothing, and a stream that only opens and closes sessions (every stage but the first) halves its writes."""

Inbox = asyncio.Queue
"""A session's: (stage index, None: opened | ForwardResponse | REROUTED | grpc.aio.AioRpcError: its fault there)."""
REROUTED = "rerouted"
"""In an inbox: the stage rerouted the session (router/repair.py)."""


class StageMux:
    def __init__(self, stage: StageEndpoint):
        self.stage = stage
        self.channel = stage.channel
        self.call = stage.stub.Sessions()
        self.inboxes: dict[str, tuple[Inbox, int]] = {}
        self.cached: dict[str, int] = {}
        """Sessions opened here with positions attached from the stage's prefix cache: how many (read once)."""
        self.broken = False
        self._batch = stage_pb2.SessionBatch()
        self._bytes = 0
        self._full: list[stage_pb2.SessionBatch] = []
        self._closes: list[str] = []
        self._close_timer: asyncio.TimerHandle | None = None
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write(), name=f"sessions-to-{stage.address}")
        self._reader = loop.create_task(self._read(), name=f"sessions-from-{stage.address}")

    def _room(self, nbytes: int) -> stage_pb2.SessionBatch:
        """The batch to add nbytes to (a new one when the current is full); the writer is woken."""
        if self._bytes + nbytes > BATCH_BYTES and self._bytes:
            self._full.append(self._batch)
            self._batch, self._bytes = stage_pb2.SessionBatch(), 0
        self._bytes += nbytes
        self._wake.set()
        return self._batch

    def open(self, request: stage_pb2.OpenSessionRequest, inbox: Inbox, index: int) -> None:
        """Opens a session here; the answer (opened, or its fault) and all that follows go to inbox,
        tagged with index (the stage's place in the session's chain)."""
        self.inboxes[request.session_id] = (inbox, index)
        self._room(request.ByteSize()).opens.append(request)

    def step(self, session_id: str, start: int, token_ids: list[int]) -> stage_pb2.ForwardRequest:
        """Queues a step of token ids; the caller may set more of its fields before it next awaits."""
        request = self._room(8 * len(token_ids) + 64).steps.add(session_id=session_id, start=start)
        ids = request.token_ids
        ids.dtype, ids.data = "int64", array("q", token_ids).tobytes()
        ids.shape.append(len(token_ids))
        return request

    def send(self, request: stage_pb2.ForwardRequest) -> None:
        """Queues a step built by the caller (a repair's rebuild: hidden states)."""
        self._room(request.ByteSize()).steps.append(request)

    def reroute(self, session_id: str, position: int, next_address: str = "", next_key: str = "",
                wait: bool = False) -> None:
        """Rewinds the session here to position and re-points it (answered REROUTED in its inbox); wait: once it
        holds position positions (steps on their way from the previous stage)."""
        self._room(len(next_address) + 96).reroute.add(session_id=session_id, position=position,
                                                       next_address=next_address, next_key=next_key, wait=wait)

    def close(self, session_id: str) -> None:
        """Closes a session here (nothing more reaches its inbox). The stage closes it anyway if the stream
        ends first."""
        self.cached.pop(session_id, None)
        if self.inboxes.pop(session_id, None) is not None and not self.broken:
            self._closes.append(session_id)
            if self._close_timer is None:
                self._close_timer = asyncio.get_running_loop().call_later(CLOSE_WAIT_S, self._wake.set)

    async def _write(self) -> None:
        loop, written_at = asyncio.get_running_loop(), 0.0
        while True:
            await self._wake.wait()
            if wait := grpc_server.busy_wait_s(len(self.inboxes), loop.time() - written_at):
                await asyncio.sleep(wait)  # busy: more steps join this message
            written_at = loop.time()
            self._wake.clear()
            batches = [*self._full, self._batch]
            self._full, self._batch, self._bytes = [], stage_pb2.SessionBatch(), 0
            if self._closes:
                batches[-1].close.extend(self._closes)
                self._closes = []
                self._close_timer.cancel()
                self._close_timer = None
            try:
                for batch in batches:
                    await self.call.write(batch)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                self.call.cancel()  # the reader sees the end and fails what the stream carried
                return

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "ended the Sessions stream"
        try:
            async for events in self.call:
                for sid in events.opened:
                    if (entry := self.inboxes.get(sid)) is not None:
                        if cached := events.cached_positions.get(sid, 0):
                            self.cached[sid] = cached
                        entry[0].put_nowait((entry[1], None))
                for sid in events.rerouted:
                    if (entry := self.inboxes.get(sid)) is not None:
                        entry[0].put_nowait((entry[1], REROUTED))
                for response in events.results:
                    if (entry := self.inboxes.get(response.session_id)) is not None:
                        entry[0].put_nowait((entry[1], response))
                for fault in events.faults:
                    if (entry := self.inboxes.pop(fault.session_id, None)) is not None:
                        fault_code = next((c for c in grpc.StatusCode if c.value[0] == fault.code),
                                          grpc.StatusCode.UNKNOWN)
                        entry[0].put_nowait((entry[1], stage_error(fault_code, self.stage.address, fault.details)))
        except grpc.aio.AioRpcError as exc:
            code, details = call_status(exc.code(), exc.details())
        finally:
            self.broken = True
            self._writer.cancel()
            if self.inboxes:
                log.warning(f"Sessions stream to stage {self.stage.address} ended: {code.name}: {details} "
                            f"({len(self.inboxes)} session(s) on it)")
            for inbox, index in self.inboxes.values():
                inbox.put_nowait((index, stage_error(code, self.stage.address, details)))
            self.inboxes.clear()


def mux_of(stage: StageEndpoint) -> StageMux:
    """The stage's mux, a new one when there is none yet, or it broke, or its channel was closed."""
    mux = stage.mux
    if mux is None or mux.broken or mux.channel is not stage.channel:
        mux = stage.mux = StageMux(stage)
    return mux
