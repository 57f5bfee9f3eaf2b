"""Repair: when one stage of a chain fails mid-stream, a stage that serves the same layer range (in another
chain) takes its place in the request's session, and only the stages that must are rebuilt; the stages after it
keep their KV caches. Replaying the whole prefix on another chain (generation.py's failover) rebuilds every stage.

The session is opened repairable (a broken link leaves its stages' sessions open). The new stage is opened
answering on its own stream and rebuilt for positions 0..position-1: from token ids (a first stage: the router has
them), else from the previous stage's output log (Stage/ReadOutput, sent as prefill chunks). A session that
started from the stages' prefix caches has no log (a stage logs only what it computed): the new stage attaches
what its own prefix cache holds of the positions, and when that is not all, the stages before it are rewound to
where it stands and compute the rest again into it (Reroute.wait: it is rerouted once it holds them all). Then
every stage is rewound to the position before the failed step (SessionBatch.reroute: what it took of that step is
dropped) and the new stage and the one before it pointed at their next; then the failed step goes again from the
router.

Replayed instead: a failure that names no stage (a hung chain's timeout), a session whose previous stage lost its
log (--repair-log-tokens), and one with no stage to take the place."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator

import grpc

from stagemesh import metrics
from stagemesh.router.chain_client import StageEndpoint
from stagemesh.router.chains import ChainSet
from stagemesh.router.prefill_window import chunks
from stagemesh.router.repair_fallback import failed_reason, fall_back, reason_of
from stagemesh.router.session import ChainSession
from stagemesh.router.session_mux import REROUTED, mux_of
from stagemesh.router.step_values import StepResult
from stagemesh.v1 import stage_pb2, tensor_pb2
from stagemesh.wire import encode_ids

log = logging.getLogger("stagemesh.router")

REPAIRABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})
"""Faults of the stage itself (dead, unreachable, hung): another stage can take its place."""


def replacement(chains: ChainSet, session: ChainSession, index: int) -> StageEndpoint | None:
    """A stage of another usable chain of the same build (fingerprint) that serves the same layers as the
    session's stage `index` and is not already in the session's chain; from the least loaded chain. Never one of
    another build, as during a rolling update (--accept-fingerprints): a pass through two builds is no model."""
    dead = session.chain.stages[index]
    taken = {s.address for s in session.chain.stages}
    for chain in sorted(chains.usable(), key=lambda c: c.in_flight + c.queued_steps):
        if dead.address in {s.address for s in chain.stages} or chain.fingerprint != session.chain.fingerprint:
            continue  # a chain through the failed stage, or of another build
        for stage in chain.stages:
            if stage.address not in taken and (stage.layer_start, stage.layer_end) == (dead.layer_start,
                                                                                       dead.layer_end):
                return stage
    return None


async def repair(session: ChainSession, stage: StageEndpoint, history: list[int], chunk: int,
                 return_logits: bool = False) -> StepResult:
    """Puts `stage` in place of the session's failed stage, rebuilds it, rewinds and re-points the chain, and
    finishes the step that failed: history is every token the session has been fed, the failed step's included;
    the answer is the last stage's for its end (the next token)."""
    index, n, position = session.failed_stage, len(session.chain.stages), session.position
    sid = session.session_id
    session.muxes[index].close(sid)  # a hung stage may still hold it
    stages = list(session.chain.stages)
    stages[index] = stage
    session.chain = dataclasses.replace(session.chain, stages=stages, chain_id=f"{session.chain.chain_id}~repaired")
    if index:
        session.hop_keys[index] = secrets.token_hex(16)
    mux = session.muxes[index] = mux_of(stage)
    opening = session.open_request(index)
    opening.ClearField("next_address")  # rebuilt on its own: nothing goes on to the next stage yet
    opening.ClearField("next_key")
    if session.attached:  # the session started from the prefix caches: the new stage's may hold its start too
        opening.prefix_ids.extend(history[:position])
        opening.prefix_salt = session.prefix_salt(index)
    mux.open(opening, session.inbox, index)
    await session.wait_for(index, None, 1, "to the repair's OpenSession")
    cached = mux.cached.pop(sid, 0)
    recompute = cached < position and index > 0 and session.attached > 0
    if recompute:  # the stages before logged nothing of the positions they attached: they compute them again
        await _recompute(session, index, history, cached, position, chunk)
    else:
        async for start, _end, tensor in _inputs(session, index, history, cached, position, chunk):
            request = stage_pb2.ForwardRequest(session_id=sid, start=start, skip_sample=True)
            (request.token_ids if index == 0 else request.hidden).CopyFrom(tensor)
            mux.send(request)
    for j in sorted(range(n), key=lambda j: j != index):  # the new stage first: once it holds every position
        target = session.muxes[j]
        if j + 1 == index:
            target.reroute(sid, position, stage.address, session.hop_keys[index])
        elif j == index and j + 1 < n:
            target.reroute(sid, position, stages[j + 1].address, session.hop_keys[j + 1], wait=recompute)
        else:
            target.reroute(sid, position, wait=recompute and j == index)
        await session.wait_for(j, REROUTED, position if j == index else 1, "while repairing the chain; replaying")
    while not session.inbox.empty():  # what the failed step left (a token that came after the fault)
        session.inbox.get_nowait()
    return await session.step(history[position:], sampling=session.sampling, chunk_size=chunk,
                              return_logits=return_logits)


async def _recompute(session: ChainSession, index: int, history: list[int], start: int, end: int,
                     chunk: int) -> None:
    """Positions start..end-1 computed again by the stages before `index` (rewound to start; the one just before
    it pointed at it) from their token ids: the inputs of stage `index`, which holds positions 0..start-1."""
    sid = session.session_id
    for j in range(index):
        target = session.muxes[j]
        if j + 1 == index:
            target.reroute(sid, start, session.chain.stages[index].address, session.hop_keys[index])
        else:
            target.reroute(sid, start)
        await session.wait_for(j, REROUTED, 1, "while repairing the chain; replaying")
    first = session.muxes[0]
    for a, b in chunks(start, end, chunk):
        first.step(sid, a, history[a:b]).skip_sample = True


async def _inputs(session: ChainSession, index: int, history: list[int], start: int, end: int,
                  chunk: int) -> AsyncIterator[tuple[int, int, tensor_pb2.Tensor]]:
    """(start, end, tensor) of stage index's inputs for positions start..end-1, chunk by chunk: token ids for a
    first stage, else what the previous stage logged."""
    if start >= end:
        return
    if index == 0:
        for a, b in chunks(start, end, chunk):
            yield a, b, encode_ids(history[a:b])
        return
    previous = session.chain.stages[index - 1]
    read = previous.stub.ReadOutput(stage_pb2.ReadOutputRequest(session_id=session.session_id, start=start, end=end,
                                                                 chunk_tokens=chunk),
                                    timeout=session.progress.timeout(session.chain, end - start))
    async for piece in read:
        rows = piece.hidden.shape[0] if piece.hidden.shape else 0
        yield piece.start, piece.start + rows, piece.hidden


def possible(session: ChainSession, exc: grpc.aio.AioRpcError) -> str:
    """Why the session cannot be repaired after exc ("" when it can)."""
    if exc.code() not in REPAIRABLE:
        return f"a {exc.code().name} is not the stage's own fault"
    if session.failed_stage is None:
        return "the fault names no stage"
    return "" if session.keep_output else "the stages keep no output logs"


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
            why = why or "no other stage of this build serves those layers"
            fall_back(reason_of(why), why, self.log_extra)
            return None
        dead = session.chain.stages[session.failed_stage]
        for chain in self.chains.usable():
            if dead.address in {s.address for s in chain.stages}:
                self.chains.mark_down(chain, f"{exc.code().name}: {exc.details()}")
        log.warning(f"stage {dead.address}[{dead.layer_start}:{dead.layer_end}] failed ({exc.code().name}: "
                    f"{exc.details()}); repairing: {stage.address} takes its place, rebuilt from {session.position} "
                    f"positions of {_source(session)}",
                    extra=self.log_extra)
        metrics.REPAIRS.inc()
        try:
            return await repair(session, stage, history, chunk)
        except grpc.aio.AioRpcError as failed:
            if failed.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # the request ends there: nothing is replayed
                fall_back(failed_reason(failed), f"the repair failed ({failed.code().name}: {failed.details()})",
                          self.log_extra)
            raise


def _source(session: ChainSession) -> str:
    """What the failed stage's replacement is rebuilt from (repair())."""
    if session.failed_stage == 0:
        return "token ids"
    if session.attached:
        return "its prefix cache, else recomputed by the stages before it"
    return "the previous stage's output log"
