"""A request's session on a chain whose stages forward to each other: the router sends token ids to
the first stage and reads the sampled tokens from the last; hidden states go stage to stage without it
(N + 1 one-way trips per token instead of 2N, and no hidden state decoded or encoded here).

The session costs no call of its own: its opens, steps and closes travel on the router's one Sessions
stream per stage (router/session_mux.py), with every other session's. Each stage reports the session's
fault there (or the stream's end does, for all it carried), and the first fault heard ends the step with
that stage's status, so the router's failure semantics (which stage, which code) are those of relay mode."""

from __future__ import annotations

import asyncio
import secrets
import time

import grpc

from stagemesh import metrics, tracing
from stagemesh.router.chain_client import ChainSession
from stagemesh.router.prefill_window import Chunk, PrefillWindow
from stagemesh.router.session_mux import StageMux, mux_of
from stagemesh.router.stage_faults import stage_error
from stagemesh.router.step_values import Sampling, StepResult
from stagemesh.v1 import stage_pb2

OPEN_SPAN = "/stagemesh.v1.Stage/OpenSession"
ABORTED = "aborted"
"""In an inbox: the session's chain was marked down (ForwardingSession.abort)."""


class ForwardingSession(ChainSession):
    """ChainSession for chains of two or more stages that forward (GenerationConfig.forwarding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # hop_keys[i]: what stage i-1 presents to stage i with each relayed step (128 random bits per hop,
        # never logged): only the stage the router chose may step stage i's session.
        self.hop_keys = ["", *(secrets.token_hex(16) for _ in self.chain.stages[1:])]
        self._inbox: asyncio.Queue = asyncio.Queue()  # (stage index, opened | result | fault), from the muxes
        self._muxes: list[StageMux] = []
        self._aborted = ""  # why its chain was marked down, once abort() was called
        self._window = PrefillWindow(0, [], 0, 1)  # the step's chunks not yet sent (prefill_window.py)
        self._step_asks: tuple[Sampling, bool] = (self.sampling, False)

    def _open_request(self, index: int) -> stage_pb2.OpenSessionRequest:
        request = super()._open_request(index)
        request.upstream_key = self.hop_keys[index]
        request.repairable = self.keep_output  # a broken link leaves it to the router (repair.py)
        if index:
            request.previous_address = self.chain.stages[index - 1].address
        if index < len(self.chain.stages) - 1:
            request.next_address = self.chain.stages[index + 1].address
            request.next_key = self.hop_keys[index + 1]
        return request

    async def __aenter__(self) -> ForwardingSession:
        try:
            await self._open_all()
        except BaseException:
            await self.close()
            raise
        self.chain.sessions.add(self)  # a chain marked down aborts it (abort())
        return self

    def abort(self, why: str) -> None:
        """Its chain was marked down (ChainSet.mark_down: a failed stream, its end-to-end probe): the step in flight,
        or the next, ends now with UNAVAILABLE naming no stage, so the stream fails over (a replay) at once instead
        of at its progress timeout. A session already handling a stage's fault (a repair) is left to it."""
        if self.failed_stage is None and self._muxes and not self._aborted:
            self._aborted = why
            self._inbox.put_nowait((None, ABORTED))

    async def _open_all(self) -> None:
        """Every stage at once: one round trip. The first fault (in chain order) is raised once all have
        answered."""
        self._muxes = [mux_of(stage) for stage in self.chain.stages]
        spans = []  # with tracing on: the opens' spans, as a unary OpenSession's would be
        for index, mux in enumerate(self._muxes):
            request = self._open_request(index)
            if span := tracing.client_span(OPEN_SPAN, request.trace_context):
                spans.append(span)
            mux.open(request, self._inbox, index)
        limit, timeout = self.progress.timeout(self.chain, 1), self._timeout()
        waiting, faults = set(range(len(self._muxes))), {}
        try:
            async with asyncio.timeout(limit if timeout is None else min(limit, timeout)):
                while waiting:
                    index, item = await self._inbox.get()
                    waiting.discard(index)
                    if item is not None:
                        faults.setdefault(index, item)
        except TimeoutError:
            if timeout is not None and timeout <= limit:
                raise deadline_exceeded() from None
            raise stage_error(grpc.StatusCode.UNAVAILABLE, self.chain.stages[min(waiting)].address,
                               f"no answer to OpenSession in {limit:.1f}s: hung or unreachable") from None
        finally:
            for span in spans:
                span.end()
        if faults:
            raise faults[min(faults)]
        self._attached([mux.cached.pop(self.session_id, 0) for mux in self._muxes])

    async def close(self) -> None:
        # Nothing waited on: a close rides the next batch (or the stream's end closes the session there).
        self.chain.sessions.discard(self)
        for mux in self._muxes:
            mux.close(self.session_id)
        self._muxes = []

    def step_ahead(self, token_ids: list[int], *, sampling: Sampling, chunk_size: int = 0) -> asyncio.Future:
        """The step's messages queued on the first stage's stream now (its writer sends them at the event
        loop's next turn); the answer is a task's."""
        self.failed_stage = None
        self._send(token_ids, sampling, chunk_size, False)
        return asyncio.ensure_future(self._answer(len(token_ids)))

    async def _answer(self, tokens: int) -> StepResult:
        return self._advance(tokens, await self._receive(tokens))

    async def _step(self, token_ids: list[int], sampling: Sampling, chunk_size: int,
                    return_logits: bool) -> stage_pb2.ForwardResponse:
        self._send(token_ids, sampling, chunk_size, return_logits)
        return await self._receive(len(token_ids))

    def _send(self, token_ids: list[int], sampling: Sampling, chunk_size: int, return_logits: bool) -> None:
        # The first chunks now; each the last stage acknowledges lets one more go (_receive): the first stage
        # computes chunk k + 1 while the next computes chunk k, and no stage is sent more than a few ahead.
        self._window = PrefillWindow(self.position, token_ids, chunk_size, len(self._muxes))
        self._step_asks = (sampling, return_logits)
        self._send_chunks(self._window.take())
        if self._token_read_at is not None:
            metrics.TOKEN_TURNAROUND.observe(time.perf_counter() - self._token_read_at)
            self._token_read_at = None

    def _send_chunks(self, chunks: list[Chunk]) -> None:
        sampling, return_logits = self._step_asks
        for chunk in chunks:
            request = self._muxes[0].step(self.session_id, chunk.start, chunk.token_ids)
            if chunk.last:
                request.return_logits = return_logits
                if sampling != self.sampling:
                    request.sampling.CopyFrom(sampling.to_pb())
            else:
                request.skip_sample = request.ack = True

    async def _receive(self, tokens: int) -> stage_pb2.ForwardResponse:
        """The last stage's answer to the step sent, or the first fault heard on the way."""
        last = len(self._muxes) - 1
        limit, timeout = self.progress.timeout(self.chain, tokens), self._timeout()
        try:
            async with asyncio.timeout(limit if timeout is None else min(limit, timeout)):  # one timer for the step
                while True:
                    index, item = await self._inbox.get()
                    if isinstance(item, BaseException):
                        self.failed_stage = index
                        raise item
                    if item is ABORTED:
                        raise grpc.aio.AioRpcError(
                            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                            details=f"chain {self.chain.chain_id} was marked down ({self._aborted}): failing over now")
                    if index == last and isinstance(item, stage_pb2.ForwardResponse) and item.ack:
                        if self._muxes:  # a chunk reached the chain's end: the next may go
                            self._send_chunks(self._window.acked())
                    elif index == last and item is not None:
                        return item
        except TimeoutError:
            if timeout is not None and timeout <= limit:
                raise deadline_exceeded() from None
            metrics.STEP_TIMEOUTS.inc()
            labels = ", ".join(s.address for s in self.chain.stages)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                details=f"chain {labels}: no token in {limit:.1f}s for a {tokens}-token step: "
                        "a stage on the way is hung, or a link is cut") from None


def deadline_exceeded() -> grpc.aio.AioRpcError:
    """The request's own deadline passed (as a call with that deadline would have ended)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="Deadline Exceeded")


def session_class(forwarding: bool, stages: int) -> type[ChainSession]:
    """The session for a chain of `stages`: forwarding needs two or more (one stage answers itself)."""
    return ForwardingSession if forwarding and stages > 1 else ChainSession
