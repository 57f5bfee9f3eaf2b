"""Repair: when one stage of a chain fails mid-stream, a stage that serves the same layer range (in
another chain) takes its place in the request's session, and only it is rebuilt: from the previous
stage's output log (Stage/ReadOutput; token ids for a first stage, which the router has), sent to it
as prefill chunks. The stages after it keep their KV caches; they only take the positions they had not
seen yet. Replaying the whole prefix on another chain (generation.py's failover) rebuilds every stage.

A forwarding session (router/forwarding.py, opened repairable: a broken link leaves its stages' sessions
open) is repaired the same way (forwarding_repair): the new stage is opened answering on its own stream,
rebuilt, then every stage is rewound to the position before the failed step and the previous one re-pointed
at it (SessionBatch.reroute), and the failed step is sent again from the router.

Replayed instead: a relay session whose stages' positions are not known (a failure while a chunked prefill
was in flight at several stages), a session whose previous stage kept no log (--repair-log-tokens), a failure
that names no stage (a hung chain's timeout), and one with no stage to take the place."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets

import grpc

from stagemesh import metrics
from stagemesh.router.chain_client import ChainSession, StageEndpoint, background
from stagemesh.router.chains import ChainSet
from stagemesh.router.forwarding import ForwardingSession, deadline_exceeded
from stagemesh.router.repair_fallback import failed_reason, fall_back, reason_of
from stagemesh.router.session_mux import REROUTED, mux_of
from stagemesh.router.step_values import StepResult
from stagemesh.v1 import stage_pb2, tensor_pb2
from stagemesh.wire import encode_ids

log = logging.getLogger("stagemesh.router")

REPAIRABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})
"""Faults of the stage itself (dead, unreachable, hung): another stage can take its place."""


def replacement(chains: ChainSet, session: ChainSession, index: int) -> StageEndpoint | None:
    """A stage of another usable chain that serves the same layers as the session's stage `index` and is
    not already in the session's chain; from the least loaded chain."""
    dead = session.chain.stages[index]
    taken = {s.address for s in session.chain.stages}
    for chain in sorted(chains.usable(), key=lambda c: c.in_flight + c.queued_steps):
        if dead.address in {s.address for s in chain.stages}:
            continue  # a chain through the failed stage
        for stage in chain.stages:
            if stage.address not in taken and (stage.layer_start, stage.layer_end) == (dead.layer_start,
                                                                                       dead.layer_end):
                return stage
    return None


def _chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    size = size or max(1, end - start)
    return [(a, min(end, a + size)) for a in range(start, end, size)]


async def repair(session: ChainSession, stage: StageEndpoint, history: list[int], chunk: int,
                 return_logits: bool = False) -> StepResult:
    """Puts `stage` in place of the session's failed stage, rebuilds it, and finishes the step that failed:
    history is every token the session has been fed, the failed step's included; the answer is the last
    stage's for its end (the next token)."""
    index, reached = session.failed_stage, session.reached
    n = len(session.chain.stages)
    target = max(p for j, p in enumerate(reached) if j != index)  # where the stages before it stand
    after = reached[index + 1] if index + 1 < n else target  # where the stages after it stand
    dead = session.chain.stages[index]
    session._streams[index].cancel()
    session._opened = [s for s in session._opened if s is not dead]
    background(session._close_sessions([dead.stub]))  # a hung stage may still hold it
    stages = list(session.chain.stages)
    stages[index] = stage
    session.chain = dataclasses.replace(session.chain, stages=stages, chain_id=f"{session.chain.chain_id}~repaired")
    await session._open(index)
    session._streams[index] = session._stream(stage)
    sampling = session.sampling

    def request(i: int, start: int, end: int, tensor: tensor_pb2.Tensor) -> stage_pb2.ForwardRequest:
        return session._request(i, start, tensor, sampling, end == len(history), return_logits)

    # The new stage: every position the stages before it hold; its output of the positions the stages
    # after it lack goes on to them (chunk bounds at `after`, so that those outputs are whole messages).
    onward: list[tuple[int, int, tensor_pb2.Tensor]] = []
    response = None
    for lo, hi in ((0, after), (after, target)):
        async for start, end, tensor in _inputs(session, index, history, lo, hi, chunk):
            response = await session._exchange(index, request(index, start, end, tensor), end - start)
            if start >= after:
                onward.append((start, end, response.hidden))
    for i in range(index + 1, n):
        sent, onward = onward, []
        for start, end, tensor in sent:
            response = await session._exchange(i, request(i, start, end, tensor), end - start)
            onward.append((start, end, response.hidden))
    session.position = target
    session.reached = [target] * n
    if target < len(history):  # the stage before it had not taken the whole step: the rest goes through as one
        return await session.step(history[target:], sampling=sampling, chunk_size=chunk, return_logits=return_logits)
    if reached[-1] >= target or response is None or not response.HasField("token_id"):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="the step's token was lost with the failed stage; replaying")
    return StepResult.from_pb(response)


async def _inputs(session: ChainSession, index: int, history: list[int], start: int, end: int, chunk: int):
    """(start, end, tensor) of stage index's inputs for positions start..end-1, chunk by chunk: token ids for a
    first stage, else what the previous stage logged."""
    if start >= end:
        return
    if index == 0:
        for a, b in _chunks(start, end, chunk):
            yield a, b, encode_ids(history[a:b])
        return
    previous = session.chain.stages[index - 1]
    read = previous.stub.ReadOutput(stage_pb2.ReadOutputRequest(session_id=session.session_id, start=start, end=end,
                                                                 chunk_tokens=chunk),
                                    timeout=session.progress.timeout(session.chain, end - start))
    async for piece in read:
        rows = piece.hidden.shape[0] if piece.hidden.shape else 0
        yield piece.start, piece.start + rows, piece.hidden


async def forwarding_repair(session: ForwardingSession, stage: StageEndpoint, history: list[int], chunk: int,
                            return_logits: bool = False) -> StepResult:
    """repair() for a forwarding session: `stage` opened in place of the failed one, answering on its own
    stream while it is rebuilt (positions 0..position-1 of the stage before it, or token ids); then, in chain
    order, each stage rewound to the position before the failed step (what it took of that step is dropped) and
    the new stage and the one before it pointed at their next; then the failed step goes again from the router."""
    index, n, position = session.failed_stage, len(session.chain.stages), session.position
    sid = session.session_id
    session._muxes[index].close(sid)  # a hung stage may still hold it
    stages = list(session.chain.stages)
    stages[index] = stage
    session.chain = dataclasses.replace(session.chain, stages=stages, chain_id=f"{session.chain.chain_id}~repaired")
    if index:
        session.hop_keys[index] = secrets.token_hex(16)
    mux = session._muxes[index] = mux_of(stage)
    opening = session._open_request(index)
    opening.ClearField("next_address")  # rebuilt on its own: nothing goes on to the next stage yet
    opening.ClearField("next_key")
    mux.open(opening, session._inbox, index)
    await _answer(session, index, None, 1)
    async for start, _end, tensor in _inputs(session, index, history, 0, position, chunk):
        request = stage_pb2.ForwardRequest(session_id=sid, start=start, skip_sample=True)
        (request.token_ids if index == 0 else request.hidden).CopyFrom(tensor)
        mux.send(request)
    for j, target in enumerate(session._muxes):
        if j + 1 == index:
            target.reroute(sid, position, stage.address, session.hop_keys[index])
        elif j == index and j + 1 < n:
            target.reroute(sid, position, stages[j + 1].address, session.hop_keys[j + 1])
        else:
            target.reroute(sid, position)
        await _answer(session, j, REROUTED, position if j == index else 1)
    while not session._inbox.empty():  # what the failed step left (a token that came after the fault)
        session._inbox.get_nowait()
    return await session.step(history[position:], sampling=session.sampling, chunk_size=chunk,
                              return_logits=return_logits)


async def _answer(session: ForwardingSession, index: int, wanted: object, tokens: int) -> None:
    """Waits for stage index's `wanted` (None: opened) in the session's inbox; a fault there is raised, what the
    failed step left is passed over."""
    limit, timeout = session.progress.timeout(session.chain, max(1, tokens)), session._timeout()
    try:
        async with asyncio.timeout(limit if timeout is None else min(limit, timeout)):
            while True:
                at, item = await session._inbox.get()
                if isinstance(item, BaseException):
                    raise item
                if at == index and item is wanted:
                    return
    except TimeoutError:
        if timeout is not None and timeout <= limit:
            raise deadline_exceeded() from None
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details=f"stage {session.chain.stages[index].address}: no answer while "
                                           "repairing the chain; replaying") from None


def possible(session: ChainSession, exc: grpc.aio.AioRpcError) -> str:
    """Why the session cannot be repaired after exc ("" when it can)."""
    if exc.code() not in REPAIRABLE:
        return f"a {exc.code().name} is not the stage's own fault"
    if session.attached and session.failed_stage:
        return "its first positions came from the stages' prefix caches, which log no output to rebuild from"
    if isinstance(session, ForwardingSession):
        if session.failed_stage is None:
            return "the fault names no stage"
        return "" if session.keep_output else "the stages keep no output logs"
    index, reached = session.failed_stage, session.reached
    if index is None or reached is None or len(session.chain.stages) < 2:
        return "where each stage stands is not known"
    if any(reached[j] != reached[0] for j in range(index)) or len(set(reached[index + 1:])) > 1:
        return "the stages stand at different positions"
    if not session.keep_output and index > 0:
        return "the stages keep no output logs"
    return ""


class Repairs:
    """A request's repairs: each one takes the place of a failover (GenerationConfig.max_failovers)."""

    def __init__(self, chains: ChainSet, enabled: bool, log_extra: dict[str, str]):
        self.chains = chains
        self.enabled = enabled
        self.log_extra = log_extra

    async def step(self, session: ChainSession, history: list[int], chunk: int,
                   exc: grpc.aio.AioRpcError) -> StepResult | None:
        """The failed step's answer through the repaired chain; None when it cannot be repaired (replay)."""
        why = possible(session, exc) if self.enabled else "repair is off"
        stage = replacement(self.chains, session, session.failed_stage) if not why else None
        if stage is None:
            why = why or "no other stage serves those layers"
            fall_back(reason_of(why), why, self.log_extra)
            return None
        dead = session.chain.stages[session.failed_stage]
        for chain in self.chains.usable():
            if dead.address in {s.address for s in chain.stages}:
                self.chains.mark_down(chain, f"{exc.code().name}: {exc.details()}")
        rebuilt = max(session.reached)
        log.warning(f"stage {dead.address}[{dead.layer_start}:{dead.layer_end}] failed ({exc.code().name}: "
                    f"{exc.details()}); repairing: {stage.address} takes its place, rebuilt from {rebuilt} positions "
                    f"of {'token ids' if session.failed_stage == 0 else 'the previous stage output log'}",
                    extra=self.log_extra)
        metrics.REPAIRS.inc()
        try:
            if isinstance(session, ForwardingSession):
                return await forwarding_repair(session, stage, history, chunk)
            return await repair(session, stage, history, chunk)
        except grpc.aio.AioRpcError as failed:
            if failed.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # the request ends there: nothing is replayed
                fall_back(failed_reason(failed), f"the repair failed ({failed.code().name}: {failed.details()})",
                          self.log_extra)
            raise
