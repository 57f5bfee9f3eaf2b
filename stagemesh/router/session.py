"""A request's session on a chain: the router sends token ids to the first stage and reads the sampled tokens
from the last; hidden states go stage to stage without it (N + 1 one-way trips per token on N stages, and no
hidden state decoded or encoded here). A one-stage chain is the same session: its stage answers itself.

The session costs no call of its own: its opens, steps and closes travel on the router's one Sessions
stream per stage (router/session_mux.py), with every other session's. Each stage reports the session's
fault there (or the stream's end does, for all it carried), and the first fault heard ends the step with
that stage's status and index (failed_stage): what a failover or a repair (router/repair.py) starts from."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc

from stagemesh import metrics, tracing
from stagemesh.router.chain_client import Chain, Progress
from stagemesh.router.prefill_window import Chunk, PrefillWindow
from stagemesh.router.session_mux import StageMux, mux_of
from stagemesh.router.step_values import Sampling, StepResult
from stagemesh.v1 import stage_pb2

OPEN_SPAN = "/stagemesh.v1.Stage/OpenSession"
ABORTED = "aborted"
"""In an inbox: the session's chain was marked down (ChainSession.abort)."""


def deadline_exceeded() -> grpc.aio.AioRpcError:
    """The request's own deadline passed (as a call with that deadline would have ended)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="Deadline Exceeded")


def unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=details)


class ChainSession:
    """One request's session on every stage of a chain.

    Use as `async with ChainSession(chain, ...) as s:`; leaving the block closes every stage's session,
    whatever the way out (done, error, cancellation), without waiting on a stage that may be dead: the closes
    ride the streams' next messages (and a stream's end closes what it carried)."""

    def __init__(self, chain: Chain, max_length: int, request_id: str, deadline: float | None = None,
                 wire_dtype: str = "", progress: Progress | None = None, sampling: Sampling | None = None,
                 keep_output: bool = False, prefix_ids: list[int] | None = None,
                 history: Callable[[], list[int]] | None = None, prompt_length: int = 0, cache_scope: str = ""):
        self.chain = chain
        # Penalties: the request's tokens so far (prompt, then generated) and how many are the prompt's, told the
        # last stage at every open (a repair's too) when the sampling has a penalty; it keeps them by position.
        self.history = history
        self.prompt_length = prompt_length
        # Prefix caching: what the session starts with (all but the last token it will be stepped with), told
        # every stage at open; each attaches what it has cached of it, and the session starts at the least.
        self.prefix_ids = prefix_ids or []
        self.cache_scope = cache_scope  # whose blocks it may attach and leave (router/cache_scope.py)
        self.attached = 0  # positions every stage attached from its prefix cache at open
        self.keep_output = keep_output  # stages log what they send on, and outlive a broken link, for repair
        self.sampling = sampling or Sampling()  # told the last stage once, at open; a step may ask otherwise
        self.progress = progress or Progress()
        self.wire_dtype = wire_dtype  # how stages send hidden states on ("": their own dtype)
        self.max_length = max_length
        self.request_id = request_id
        self.deadline = deadline  # loop.time() by which the request must be done
        # 128 random bits: the id is what lets its opener step the session, so none can guess it; logs
        # show the request id and a short prefix of it only.
        self.session_id = secrets.token_hex(16)
        self.position = 0  # positions every stage holds (after the last step answered)
        self.failed_stage: int | None = None  # the stage whose fault ended the last step (None: none named)
        # hop_keys[i]: what stage i-1 presents to stage i with each relayed step (128 random bits per hop,
        # never logged): only the stage the router chose may step stage i's session.
        self.hop_keys = ["", *(secrets.token_hex(16) for _ in chain.stages[1:])]
        self.inbox: asyncio.Queue = asyncio.Queue()  # (stage index, opened | result | fault), from the muxes
        self.muxes: list[StageMux] = []
        self._token_read_at: float | None = None  # when the last token came back, for TOKEN_TURNAROUND
        self._aborted = ""  # why its chain was marked down, once abort() was called
        self._window = PrefillWindow(0, [], 0, 1)  # the step's chunks not yet sent (prefill_window.py)
        self._step_asks: tuple[Sampling, bool] = (self.sampling, False)

    @contextlib.asynccontextmanager
    async def within(self, tokens: int, late: Callable[[float], str]) -> AsyncIterator[None]:
        """The one deadline policy: what runs inside must end within the progress timeout for a `tokens`-token
        step (else UNAVAILABLE, late(limit) saying who is late) and within the request's deadline (else
        DEADLINE_EXCEEDED, as a call with that deadline would end)."""
        limit = self.progress.timeout(self.chain, max(1, tokens))
        timeout = None if self.deadline is None else max(0.001, self.deadline - asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(limit if timeout is None else min(limit, timeout)):  # one timer for the wait
                yield
        except TimeoutError:
            if timeout is not None and timeout <= limit:
                raise deadline_exceeded() from None
            raise unavailable(late(limit)) from None

    def open_request(self, index: int) -> stage_pb2.OpenSessionRequest:
        """Stage index's session: what stays the same for every step is said here, once."""
        n = len(self.chain.stages)
        request = stage_pb2.OpenSessionRequest(session_id=self.session_id, max_length=self.max_length,
                                               request_id=self.request_id, upstream_key=self.hop_keys[index],
                                               repairable=self.keep_output)
        if index == n - 1:
            request.sampling.CopyFrom(self.sampling.to_pb())
            if self.sampling.penalised:
                request.token_history.extend(self.history() if self.history is not None else [])
                request.prompt_length = self.prompt_length
        else:
            request.wire_dtype = self.wire_dtype
            request.keep_output = self.keep_output
            request.next_address = self.chain.stages[index + 1].address
            request.next_key = self.hop_keys[index + 1]
        if index:
            request.previous_address = self.chain.stages[index - 1].address
        if self.prefix_ids:
            request.prefix_ids.extend(self.prefix_ids)
            request.prefix_salt = self.prefix_salt(index)
        return request

    def prefix_salt(self, index: int) -> str:
        """Whose blocks they are (the caller's cache scope), and what stage index's inputs depend on besides the
        tokens: the build (the chain's fingerprint: model version, dtype, quantization), the wire dtype and how the
        layers before it are split; its cached blocks are shared under the same salt only. Not which stages those
        were: the same layers of the same build compute the same inputs, so a stage that served a prompt after one
        chain's stages attaches it after another's (a repair's new stage, a chain re-planned around it)."""
        before = ",".join(f"[{s.layer_start}:{s.layer_end}]" for s in self.chain.stages[:index])
        return f"{self.cache_scope}|{self.chain.fingerprint}|{self.wire_dtype if index else ''}|{before}"

    async def __aenter__(self) -> ChainSession:
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
        if self.failed_stage is None and self.muxes and not self._aborted:
            self._aborted = why
            self.inbox.put_nowait((None, ABORTED))

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _open_all(self) -> None:
        """Every stage at once: one round trip. The first fault (in chain order) is raised once all have
        answered. The session starts where every stage has its positions (stages that attached more from their
        prefix caches let go of the rest at the first step)."""
        self.muxes = [mux_of(stage) for stage in self.chain.stages]
        spans = []  # with tracing on: the opens' spans, as a unary OpenSession's would be
        for index, mux in enumerate(self.muxes):
            request = self.open_request(index)
            if span := tracing.client_span(OPEN_SPAN, request.trace_context):
                spans.append(span)
            mux.open(request, self.inbox, index)
        waiting, faults = set(range(len(self.muxes))), {}
        try:
            async with self.within(1, lambda limit: f"stage {self.chain.stages[min(waiting)].address}: no answer to "
                                              f"OpenSession in {limit:.1f}s: hung or unreachable"):
                while waiting:
                    index, item = await self.inbox.get()
                    waiting.discard(index)
                    if item is not None:
                        faults.setdefault(index, item)
        finally:
            for span in spans:
                span.end()
        if faults:
            raise faults[min(faults)]
        self.attached = self.position = min(mux.cached.pop(self.session_id, 0) for mux in self.muxes)
        self.prefix_ids = []
        if self.attached:
            metrics.PREFIX_HIT_TOKENS.inc(self.attached)

    async def close(self) -> None:
        # Nothing waited on: a close rides the next batch (or the stream's end closes the session there).
        self.chain.sessions.discard(self)
        for mux in self.muxes:
            mux.close(self.session_id)
        self.muxes = []

    async def step(self, token_ids: list[int], *, sampling: Sampling, chunk_size: int = 0,
                   return_logits: bool = False) -> StepResult:
        """Feeds token_ids at the session's position and returns the last stage's answer (the next token). With
        chunk_size > 0 a long input goes in chunks, all sent at once: stage i works on chunk k while stage i-1
        works on chunk k+1."""
        self.send(token_ids, sampling, chunk_size, return_logits)
        return await self.answer(len(token_ids))

    def step_ahead(self, token_ids: list[int], *, sampling: Sampling, chunk_size: int = 0) -> asyncio.Future:
        """step(), its messages queued on the first stage's stream now (its writer sends them at the event
        loop's next turn); the answer is a task's, awaited later."""
        self.send(token_ids, sampling, chunk_size, False)
        return asyncio.ensure_future(self.answer(len(token_ids)))

    def send(self, token_ids: list[int], sampling: Sampling, chunk_size: int, return_logits: bool) -> None:
        # The first chunks now; each the last stage acknowledges lets one more go (answer()): the first stage
        # computes chunk k + 1 while the next computes chunk k, and no stage is sent more than a few ahead.
        self.failed_stage = None
        self._window = PrefillWindow(self.position, token_ids, chunk_size, len(self.muxes))
        self._step_asks = (sampling, return_logits)
        self._send_chunks(self._window.take())
        if self._token_read_at is not None:
            metrics.TOKEN_TURNAROUND.observe(time.perf_counter() - self._token_read_at)
            self._token_read_at = None

    def _send_chunks(self, chunks: list[Chunk]) -> None:
        sampling, return_logits = self._step_asks
        for chunk in chunks:
            request = self.muxes[0].step(self.session_id, chunk.start, chunk.token_ids)
            if not chunk.last:
                request.skip_sample = request.ack = True
                continue
            request.return_logits = return_logits
            if sampling != self.sampling:
                request.sampling.CopyFrom(sampling.to_pb())

    async def answer(self, tokens: int) -> StepResult:
        """The last stage's answer to the step sent (every stage then holds its tokens), or the first fault
        heard on the way."""
        last = len(self.muxes) - 1
        labels = ", ".join(s.address for s in self.chain.stages)

        def late(limit: float) -> str:
            metrics.STEP_TIMEOUTS.inc()
            return (f"chain {labels}: no token in {limit:.1f}s for a {tokens}-token step: a stage on the way is "
                    "hung, or a link is cut")

        async with self.within(tokens, late):
            while True:
                index, item = await self.inbox.get()
                if isinstance(item, BaseException):
                    self.failed_stage = index
                    raise item
                if item is ABORTED:
                    raise unavailable(f"chain {self.chain.chain_id} was marked down ({self._aborted}): "
                                      "failing over now")
                if index == last and isinstance(item, stage_pb2.ForwardResponse):
                    if not item.ack:
                        break
                    if self.muxes:  # a chunk reached the chain's end: the next may go
                        self._send_chunks(self._window.acked())
        self.position += tokens
        self._token_read_at = time.perf_counter()
        self.chain.answered_at = time.monotonic()  # traffic got through (router/chain_probe.py)
        return StepResult.from_pb(item)

    async def wait_for(self, index: int, wanted: object, tokens: int, what: str) -> None:
        """Waits for stage index's `wanted` (None: opened; session_mux.REROUTED) in the inbox; a fault there is
        raised (its stage named in failed_stage), what a failed step left is passed over."""
        async with self.within(tokens, lambda _limit: f"stage {self.chain.stages[index].address}: no answer {what}"):
            while True:
                at, item = await self.inbox.get()
                if isinstance(item, BaseException):
                    self.failed_stage = at
                    raise item
                if at == index and item is wanted:
                    return
