"""Stage/Sessions: one router's many sessions on one long-lived stream, their traffic batched both ways.

The router opens sessions on it, sends the first stage's steps and closes sessions; this stage answers
each open, the last stage's tokens, and each session's fault, as they come, in messages holding whatever
was queued. Per session: only this stream's connection steps it, its steps run in the order sent, and
the stream's end closes it. A session's fault ends that session only."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from stagemesh import grpc_server, tracing
from stagemesh.errors import ErrorCodes, StatusError
from stagemesh.stage_server.engine.kv_pool import PoolExhausted
from stagemesh.stage_server.engine.step_inputs import check_inputs
from stagemesh.stage_server.service.backpressure import stream_budget
from stagemesh.stage_server.service.callers import caller_of
from stagemesh.stage_server.service.sessions import UnknownSession
from stagemesh.v1 import stage_pb2

log = logging.getLogger("stagemesh.stage")

StageService = Any
"""stage_service.StageService, which imports this module (its methods are used, never its module)."""

REROUTED = object()
"""Queued for a session rerouted (SessionBatch.reroute): answered in SessionEvents.rerouted."""
_END = object()
_streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""StageService -> its SessionStreams now serving."""


async def serve(service: StageService, requests: AsyncIterator[stage_pb2.SessionBatch],
                context: grpc.aio.ServicerContext, codes: ErrorCodes,
                admit: Callable[[], None] | None = None) -> AsyncIterator[stage_pb2.SessionEvents]:
    """Stage/Sessions on `service` (the slice served when the call began: end_streams ends it with it)."""
    stream = SessionStream(service, context, codes, admit)
    streams = _streams.setdefault(service, set())
    streams.add(stream)
    try:
        async for events in stream.serve(requests):
            yield events
    finally:
        streams.discard(stream)


def end_streams(service: StageService) -> None:
    """Ends every Sessions stream of `service` (UNAVAILABLE): the stage stops or swaps its slice, and the
    routers open their sessions elsewhere, or here again on a new stream."""
    for stream in _streams.pop(service, ()):
        stream.end("this stage stopped or swapped its slice")


class _Feed:
    """A session's results and fault (Route.deliver), queued on its stream tagged with its id."""

    __slots__ = ("stream", "request_id", "session_id")

    def __init__(self, stream: SessionStream, session_id: str, request_id: str = ""):
        self.stream, self.session_id, self.request_id = stream, session_id, request_id

    def put_nowait(self, item: object) -> None:
        self.stream.put(self.session_id, item)


def status_of(exc: BaseException, codes: ErrorCodes, where: str, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """A session's fault as its router hears it: a refusal's own code and text; a bug is INTERNAL, logged with the
    request id, its text kept from the caller (as the stage's StatusInterceptor does for a whole call)."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    code = next((codes[cls] for cls in type(exc).__mro__ if cls in codes), None)
    if code is not None:
        return code, str(exc)
    log.error(f"unexpected error in a session of {where}", exc_info=exc, extra={"request_id": request_id})
    return (grpc.StatusCode.INTERNAL,
            f"internal error in Stage/Sessions on {where}; the stage logged it with request id {request_id}")


class SessionStream:
    """One Sessions call: `serve` yields the stage's SessionEvents while a reader task takes the router's
    batches. `admit` (the server's) refuses opens while the stage drains. `budget` counts the steps taken and not
    yet run and the events not yet written: while it is full the reader reads nothing (backpressure.py), so a
    router that stops reading, or sends faster than the stage computes, is held back by HTTP/2 flow control."""

    def __init__(self, service: StageService, context: grpc.aio.ServicerContext, codes: ErrorCodes,
                 admit: Callable[[], None] | None = None):
        self.service = service
        self.caller = caller_of(context)  # the connection owns what it opens
        self.context = context
        self.codes = codes
        self.admit = admit
        # (session id, OpenSessionResponse: opened | REROUTED | ForwardResponse | an exception: its fault)
        self.events: asyncio.Queue = asyncio.Queue()
        self.budget = stream_budget(service.queues)
        self.feeds: dict[str, _Feed] = {}  # the sessions this stream opened or stepped: closed with it
        self.running: set[asyncio.Task] = set()

    def end(self, why: str) -> None:
        """Ends the stream from this side, UNAVAILABLE (the stage stops or swaps its slice)."""
        self.put(None, StatusError(grpc.StatusCode.UNAVAILABLE, why))

    def put(self, session_id: str | None, item: object) -> None:
        """An event for the router (counted in the budget until it is written)."""
        self.budget.take()
        self.events.put_nowait((session_id, item))

    async def serve(self, requests: AsyncIterator[stage_pb2.SessionBatch]) -> AsyncIterator[stage_pb2.SessionEvents]:
        loop, written_at = asyncio.get_running_loop(), 0.0
        reader = loop.create_task(self._read(requests))
        self.service.budgets.add(self.budget)
        try:
            while True:
                session_id, item = await self.events.get()
                if wait := grpc_server.busy_wait_s(len(self.feeds), loop.time() - written_at):
                    await asyncio.sleep(wait)  # busy: more results join this message
                written_at = loop.time()
                events, taken = stage_pb2.SessionEvents(), 1
                while True:  # everything queued by now, in one message
                    if item is _END:
                        if events.ByteSize():
                            yield events
                        return
                    if session_id is None:  # the stream's own end
                        raise item
                    self._add(events, session_id, item)
                    if self.events.empty():
                        break
                    session_id, item = self.events.get_nowait()
                    taken += 1
                yield events
                self.budget.give(items=taken)
        finally:
            self.service.budgets.discard(self.budget)
            reader.cancel()
            for task in self.running:
                task.cancel()
            sessions = self.service.sessions
            for sid in self.feeds:  # the stream was their lifeline: nothing will step them again
                session = sessions.sessions.get(sid)
                if session is not None and sessions.close(sid, self.caller):
                    log.info("session closed with its stream", extra=self.service._extra(sid, session.request_id))

    def _add(self, events: stage_pb2.SessionEvents, session_id: str, item: object) -> None:
        if isinstance(item, stage_pb2.OpenSessionResponse):
            events.opened.append(session_id)
            if item.cached_positions:
                events.cached_positions[session_id] = item.cached_positions
        elif item is REROUTED:
            events.rerouted.append(session_id)
        elif isinstance(item, BaseException):
            feed = self.feeds.get(session_id)
            code, details = status_of(item, self.codes, self.service.address, feed.request_id if feed else "")
            events.faults.add(session_id=session_id, code=code.value[0], details=details)
        else:
            events.results.append(item)

    async def _read(self, requests: AsyncIterator[stage_pb2.SessionBatch]) -> None:
        try:
            async for batch in requests:
                for request in batch.opens:
                    await self._open(request)
                for request in batch.steps:
                    self._step(request)
                for request in batch.reroute:
                    self._reroute(request)
                for sid in batch.close:
                    session = self.service.sessions.sessions.get(sid)
                    if self.feeds.pop(sid, None) is not None and self.service.sessions.close(sid, self.caller):
                        log.info("session closed by its router", extra=self.service._extra(sid, session.request_id))
                if len(self.feeds) > 64 and len(self.feeds) > 2 * len(self.service.sessions):
                    self.feeds = {s: f for s, f in self.feeds.items() if s in self.service.sessions.sessions}
                batch = request = None  # its steps are held by their tasks only
                await self.budget.room()  # full: read no more until steps have run and events were written
            self.put(None, _END)
        except Exception as exc:  # the call itself failed: the stream ends with it
            self.put(None, exc)

    async def _open(self, request: stage_pb2.OpenSessionRequest) -> None:
        span = tracing.server_span("/stagemesh.v1.Stage/OpenSession", request.trace_context)
        try:
            if self.admit is not None:
                self.admit()
            opened = await self.service.OpenSession(request, self.context)
        except Exception as exc:
            self.put(request.session_id, exc)
            return
        finally:
            if span is not None:
                span.end()
        feed = self.feeds[request.session_id] = _Feed(self, request.session_id, request.request_id)
        self.put(request.session_id, opened)
        self.service.sessions.sessions[request.session_id].route.attach(feed)

    def _step(self, request: stage_pb2.ForwardRequest) -> None:
        """A step, checked here, run (and decoded) in its session's order on a task of its own."""
        service = self.service
        try:
            session = service.sessions.get(request.session_id, self.caller)  # only the opener's
        except UnknownSession as exc:
            self.put(request.session_id, exc)
            return
        feed = self.feeds.get(session.session_id)
        if feed is None:  # opened with OpenSession, stepped here first
            feed = self.feeds[session.session_id] = _Feed(self, session.session_id, session.request_id)
            session.route.attach(feed)
        try:
            check_inputs(service.model, request)
        except StatusError as exc:  # ill-formed: this session fails, no other
            service._fail(session.session_id, exc)
            return
        service.relay(session, request, self.running, self.budget)

    def _reroute(self, request: stage_pb2.Reroute) -> None:
        """Repair: the session rewound to request.position and re-pointed, after the steps sent before it."""
        try:
            session = self.service.sessions.get(request.session_id, self.caller)  # only the opener's
        except UnknownSession as exc:
            self.put(request.session_id, exc)
            return
        session.route.in_order(self._rerouted(session, request), self.running)

    async def _rerouted(self, session, request: stage_pb2.Reroute) -> None:
        route = session.route
        while True:
            async with route.order:  # after the steps queued before it (a lock's waiters go first come, first served)
                if session.closed:
                    return
                if not (request.wait and session.cache.length < request.position):
                    self._rewind(session, request)
                    return
                route.stepped.clear()
            await route.stepped.wait()  # the steps on their way (relayed by the previous stage) run meanwhile

    def _rewind(self, session, request: stage_pb2.Reroute) -> None:
        """The session rewound to request.position and re-pointed, its order held: REROUTED, or its fault."""
        route, cache = session.route, session.cache
        if not 0 <= request.position <= cache.length:
            self.service._fail(session.session_id, StatusError(
                grpc.StatusCode.FAILED_PRECONDITION, f"cannot rewind to position {request.position}: the "
                f"session holds positions 0..{cache.length - 1}"))
            return
        try:
            cache.pool.rewind(cache, request.position)  # attention reads positions < length: the rest is rewritten
        except PoolExhausted as exc:
            self.service._fail(session.session_id, exc)
            return
        if session.output is not None and not session.output.lost:
            session.output.length = min(session.output.length, request.position)
        if request.next_address:
            try:
                self.service.links.check(request.next_address)
            except StatusError as exc:
                self.service._fail(session.session_id, exc)
                return
            route.next_address, route.next_key = request.next_address, request.next_key
        self.put(session.session_id, REROUTED)
