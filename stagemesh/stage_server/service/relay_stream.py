"""Stage/Relay: a previous stage's link, carrying the steps of every session it forwards here. Each step is checked
on arrival (an ill-formed or unknown one is answered at once, on the link, and costs only its session) and run in
its session's order; the link is read no further while its steps in flight fill --stream-queue-* (backpressure.py),
so a stage that lags holds its previous stage back instead of queueing without bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from stagemesh import metrics
from stagemesh.errors import StatusError
from stagemesh.stage_server.engine.step_inputs import check_inputs
from stagemesh.stage_server.service.backpressure import stream_budget
from stagemesh.stage_server.service.sessions import UnknownSession
from stagemesh.v1 import stage_pb2

StageService = Any
"""stage_service.StageService, which imports this module (its methods are used, never its module)."""
_WIRE_IN = metrics.WIRE_BYTES.labels("in")


async def serve(service: StageService, requests: AsyncIterator[stage_pb2.RelayBatch]
                ) -> AsyncIterator[stage_pb2.RelayStatus]:
    carried: set[str] = set()
    running: set[asyncio.Task] = set()
    budget = stream_budget(service.queues)
    service.budgets.add(budget)
    try:
        async for batch in requests:
            _WIRE_IN.inc(batch.ByteSize())
            for request in batch.steps:  # each checked and started on a task of its own; one refused is answered
                try:
                    session = service.sessions.relayed(request.session_id, request.hop_key)
                except UnknownSession as exc:
                    yield stage_pb2.RelayStatus(session_id=request.session_id,
                                                code=grpc.StatusCode.NOT_FOUND.value[0], details=str(exc))
                    continue
                carried.add(session.session_id)
                try:
                    check_inputs(service.model, request)
                except StatusError as exc:  # ill-formed: that session's step is lost
                    service._fail(session.session_id, exc)
                    yield stage_pb2.RelayStatus(session_id=request.session_id, code=exc.code.value[0],
                                                details=exc.message)
                    continue
                service.relay(session, request, running, budget)
            batch = request = None  # its steps are held by their tasks only
            if len(carried) > 2 * len(service.sessions) + 64:
                carried = {s for s in carried if s in service.sessions.sessions}
            await budget.room()  # full: read no more of the link until some steps have run
    finally:
        service.budgets.discard(budget)
        for task in running:
            task.cancel()
        for sid in carried:
            session = service.sessions.sessions.get(sid)
            previous = session.route.previous_address if session is not None else ""
            service._fail(sid, StatusError(grpc.StatusCode.UNAVAILABLE,
                                           f"the link from the previous stage {previous} ended (it stopped, or the "
                                           "link broke)"), link=True)
