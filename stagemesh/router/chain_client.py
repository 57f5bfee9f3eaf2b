"""The router's side of a pipeline chain: a request's sessions on every stage, stepped over one
long-lived bidirectional stream per stage (a unary call per token would cost twice the latency)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from stagemesh import grpc_server, metrics
from stagemesh.errors import REQUEST_ID_KEY
from stagemesh.router.stage_faults import call_status, stage_error
from stagemesh.router.step_values import Sampling, StepResult
from stagemesh.tls import Tls
from stagemesh.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from stagemesh.wire import encode_ids

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
    """Its Stage/Sessions stream, for forwarding sessions (router.session_mux.mux_of)."""
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
CLOSE_TIMEOUT_S = 0.5
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
    """Forwarding sessions open on it (router.forwarding): marking it down aborts them (ChainSet.mark_down)."""
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


class ChainSession:
    """One request's inference session on every stage of a chain.

    Use as `async with ChainSession(chain, ...) as s:`; leaving the block closes every
    stage's session, whatever the way out (done, error, cancellation), without waiting on a stage
    that may be dead: the streams are cancelled at once and the sessions closed in the background."""

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
        self.keep_output = keep_output  # stages log what they send on, so that one stage can be repaired
        self.sampling = sampling or Sampling()  # told the last stage once, at open; a step may ask otherwise
        self.progress = progress or Progress()
        self.wire_dtype = wire_dtype  # how stages send hidden states on ("": their own dtype)
        self.max_length = max_length
        self.request_id = request_id
        self.deadline = deadline  # loop.time() by which the request must be done
        # 128 random bits: the id is what lets its opener step the session, so none can guess it; logs
        # show the request id and a short prefix of it only.
        self.session_id = secrets.token_hex(16)
        self.position = 0  # positions already in every stage's cache
        # Positions in each stage's cache (they differ after a failed step; None: not known, mid-pipeline),
        # and the stage whose failure ended the last step: what a repair starts from (router/repair.py).
        self.reached: list[int] | None = [0] * len(chain.stages)
        self.failed_stage: int | None = None
        self._token_read_at: float | None = None  # when the last token came back, for TOKEN_TURNAROUND
        self._streams: list[grpc.aio.StreamStreamCall] = []
        self._opened: list[StageEndpoint] = []
        self._answered: set[int] = set()
        """Stages (by index) known to hold the session on its stream: they close it when the stream ends."""

    def _timeout(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.001, self.deadline - asyncio.get_running_loop().time())

    def _open_request(self, index: int) -> stage_pb2.OpenSessionRequest:
        """Stage index's session: what stays the same for every step is said here, once."""
        request = stage_pb2.OpenSessionRequest(session_id=self.session_id, max_length=self.max_length,
                                               request_id=self.request_id)
        if index == len(self.chain.stages) - 1:
            request.sampling.CopyFrom(self.sampling.to_pb())
            if self.sampling.penalised:
                request.token_history.extend(self.history() if self.history is not None else [])
                request.prompt_length = self.prompt_length
        else:
            request.wire_dtype = self.wire_dtype
            request.keep_output = self.keep_output
        if self.prefix_ids:
            request.prefix_ids.extend(self.prefix_ids)
            request.prefix_salt = self.prefix_salt(index)
        return request

    def prefix_salt(self, index: int) -> str:
        """Whose blocks they are (the caller's cache scope), and what stage index's inputs depend on besides the
        tokens: the model version, the wire dtype and the stages before it (their addresses and layers); its cached
        blocks are shared under the same salt only."""
        before = ",".join(f"{s.address}[{s.layer_start}:{s.layer_end}]" for s in self.chain.stages[:index])
        return f"{self.cache_scope}|{self.chain.fingerprint}|{self.wire_dtype if index else ''}|{before}"

    def _attached(self, cached: list[int]) -> None:
        """After the opens: the session starts where every stage has its positions (stages that attached more
        let go of the rest at the first step); a later open (a repair's) attaches nothing."""
        self.attached = self.position = min(cached)
        self.reached = [self.position] * len(self.chain.stages)
        self.prefix_ids = []
        if self.attached:
            metrics.PREFIX_HIT_TOKENS.inc(self.attached)

    async def _open(self, index: int) -> int:
        """Opens the session on stage index; the positions it attached from its prefix cache."""
        stage = self.chain.stages[index]
        limit = self.progress.timeout(self.chain, 1)
        timeout = self._timeout()
        try:
            opened = await stage.stub.OpenSession(self._open_request(index),
                                                  timeout=limit if timeout is None else min(limit, timeout),
                                                  metadata=((REQUEST_ID_KEY, self.request_id),))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (timeout is None or limit < timeout):
                raise stage_error(grpc.StatusCode.UNAVAILABLE, stage.address,
                                   f"no answer to OpenSession in {limit:.1f}s: hung or unreachable") from None
            raise
        self._opened.append(stage)
        return opened.cached_positions

    def _stream(self, stage: StageEndpoint) -> grpc.aio.StreamStreamCall:
        return stage.stub.Forward(timeout=self._timeout(), metadata=((REQUEST_ID_KEY, self.request_id),))

    async def _open_streams(self) -> None:
        for index, stage in enumerate(self.chain.stages):
            call = self._stream(stage)
            self._streams.append(call)
            if index:  # held by this stream from now on: its first step may wait long on the stages before
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):  # said at the first read
                    await call.write(stage_pb2.ForwardRequest(session_id=self.session_id, follow=True))

    async def __aenter__(self) -> ChainSession:
        try:
            # Every stage at once: one round trip, not one per stage. The first failure (in chain order) is
            # raised once all have answered, so that every session opened is known and closed.
            results = await asyncio.gather(*(self._open(i) for i in range(len(self.chain.stages))),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            self._attached(results)
            await self._open_streams()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for call in self._streams:
            # Ending the stream closes the stage's session too; cancel() also covers a
            # stream whose other side is stuck.
            call.cancel()
        self._streams.clear()
        # Belt and braces for a stage that may have missed the stream's end (it never read from it); never
        # waited on, so a failover does not wait for the dead. The stubs as they are now: a channel closed
        # meanwhile (a withdrawn chain) is not reopened.
        answered = {id(self.chain.stages[i]) for i in self._answered}
        unsure = [s for s in self._opened if id(s) not in answered]
        if unsure:
            background(self._close_sessions([s.stub for s in unsure]))
        self._opened.clear()
        self._answered.clear()

    async def _close_sessions(self, stubs: list[stage_pb2_grpc.StageStub]) -> None:
        request = stage_pb2.CloseSessionRequest(session_id=self.session_id)

        async def close_one(stub: stage_pb2_grpc.StageStub) -> None:
            with contextlib.suppress(Exception, asyncio.CancelledError):  # best effort (a closed channel too)
                await stub.CloseSession(request, timeout=CLOSE_TIMEOUT_S)

        await asyncio.gather(*(close_one(s) for s in stubs))

    def _request(self, index: int, start: int, tensor: tensor_pb2.Tensor, sampling: Sampling,
                 is_last_chunk: bool, return_logits: bool) -> stage_pb2.ForwardRequest:
        """Stage index's request for a chunk at `start`: token ids for the first stage, hidden states
        for the others; the last stage also gets the sampling (and samples only after the last chunk)."""
        request = stage_pb2.ForwardRequest(session_id=self.session_id, start=start)
        if index == 0:
            request.token_ids.CopyFrom(tensor)
        else:
            request.hidden.CopyFrom(tensor)
        if index == len(self.chain.stages) - 1:
            if sampling != self.sampling:
                request.sampling.CopyFrom(sampling.to_pb())
            request.skip_sample = not is_last_chunk
            request.return_logits = return_logits and is_last_chunk
        return request

    async def _exchange(self, index: int, request: stage_pb2.ForwardRequest, tokens: int,
                        ) -> stage_pb2.ForwardResponse:
        call = self._streams[index]
        stage = self.chain.stages[index]
        limit = self.progress.timeout(self.chain, tokens)
        try:
            async with asyncio.timeout(limit):  # one timer for the hop (no task per write or read, as wait_for)
                await call.write(request)
                if index == 0 and self._token_read_at is not None:
                    metrics.TOKEN_TURNAROUND.observe(time.perf_counter() - self._token_read_at)
                    self._token_read_at = None
                response = await call.read()
        except asyncio.InvalidStateError:  # the stream had already ended: its status says why
            response = grpc.aio.EOF
        except grpc.aio.AioRpcError as exc:
            self.failed_stage = index
            code, details = call_status(exc.code(), exc.details())
            raise stage_error(code, stage.address, details) from None
        except TimeoutError:
            self.failed_stage = index
            call.cancel()
            metrics.STEP_TIMEOUTS.inc()
            raise stage_error(grpc.StatusCode.UNAVAILABLE, stage.address,
                               f"no progress on a {tokens}-token step in {limit:.1f}s: hung or unreachable") from None
        if response is grpc.aio.EOF:
            code, details = call_status(await call.code(), await call.details())
            if code == grpc.StatusCode.OK:
                code, details = grpc.StatusCode.UNAVAILABLE, "ended the stream"
            self.failed_stage = index
            raise stage_error(code, stage.address, details)
        self._answered.add(index)  # it holds the session on this stream: it closes there when the stream ends
        return response

    async def step(
        self,
        token_ids: list[int],
        *,
        sampling: Sampling,
        chunk_size: int = 0,
        return_logits: bool = False,
    ) -> StepResult:
        """Feeds token_ids at the session's position and returns the last stage's answer
        (the next token). With chunk_size > 0 a long input flows through the chain in chunks,
        stage i working on chunk k while stage i-1 works on chunk k+1."""
        self.failed_stage = None
        return self._advance(len(token_ids), await self._step(token_ids, sampling, chunk_size, return_logits))

    def step_ahead(self, token_ids: list[int], *, sampling: Sampling, chunk_size: int = 0) -> asyncio.Future:
        """step(), started now and awaited later (the router's next decode step, before the caller's copy of
        this token). Here it is a task, which starts at the event loop's next turn; a forwarding session queues
        the step's messages before it returns."""
        return asyncio.ensure_future(self.step(token_ids, sampling=sampling, chunk_size=chunk_size))

    def _advance(self, tokens: int, response: stage_pb2.ForwardResponse) -> StepResult:
        """A step's answer: every stage now holds its tokens."""
        self.position += tokens
        self.reached = [self.position] * len(self.chain.stages)
        self._token_read_at = time.perf_counter()
        self.chain.answered_at = time.monotonic()
        return StepResult.from_pb(response)

    async def _step(self, token_ids: list[int], sampling: Sampling, chunk_size: int,
                    return_logits: bool) -> stage_pb2.ForwardResponse:
        n_stages = len(self.chain.stages)
        if not chunk_size or len(token_ids) <= chunk_size:
            # One chunk (every decode step): the hops in order, no tasks or queues.
            tensor = encode_ids(token_ids)
            for i in range(n_stages):
                request = self._request(i, self.position, tensor, sampling, True, return_logits)
                response = await self._exchange(i, request, len(token_ids))
                self.reached[i] = self.position + len(token_ids)
                tensor = response.hidden
            return response

        self.reached = None  # chunks in flight at several stages: where each stands is not known on a failure
        chunks = [token_ids[i : i + chunk_size] for i in range(0, len(token_ids), chunk_size)]
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n_stages)]
        start = self.position
        for k, chunk in enumerate(chunks):
            queues[0].put_nowait((start, k == len(chunks) - 1, encode_ids(chunk)))
            start += len(chunk)

        async def run_stage(i: int) -> stage_pb2.ForwardResponse | None:
            last_response = None
            for _ in chunks:
                chunk_start, is_last_chunk, tensor = await queues[i].get()
                request = self._request(i, chunk_start, tensor, sampling, is_last_chunk, return_logits)
                response = await self._exchange(i, request, chunk_size)
                if i < n_stages - 1:
                    queues[i + 1].put_nowait((chunk_start, is_last_chunk, response.hidden))
                last_response = response
            return last_response

        tasks = [asyncio.ensure_future(run_stage(i)) for i in range(n_stages)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        return results[-1]
