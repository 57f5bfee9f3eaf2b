"""One request's life in the router: pick a chain, prefill, decode token by token, stop, and
move to another chain (replaying what the dead one had) when a stage dies mid-stream."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from stagemesh import metrics
from stagemesh.config_flags import refused
from stagemesh.errors import StatusError
from stagemesh.router.chain_client import Progress
from stagemesh.router.chains import ChainSet, NoUsableChain
from stagemesh.router.detokenizer import IncrementalText
from stagemesh.router.repair import Repairs
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling, TokenLogprob
from stagemesh.wire import WIRE_DTYPES

log = logging.getLogger("stagemesh.router")

# What a stage's status says about where the fault lies. A chain is marked down only for faults of
# the chain; a fault of this session on that chain moves the stream without blaming the chain.
CHAIN_FAULTS = frozenset({
    grpc.StatusCode.UNAVAILABLE,  # dead, unreachable, hung (the progress timeout), or stopping
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
})
SESSION_FAULTS = frozenset({
    grpc.StatusCode.INTERNAL,  # a step that failed alone on the stage
    grpc.StatusCode.CANCELLED,  # on a call other than a step's (a step's is the stage stopping: call_status)
    grpc.StatusCode.NOT_FOUND,  # the session is gone (expired, stage restarted)
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,  # after the router's validation: positions or a mismatch, not the caller
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS,
})
FULL = grpc.StatusCode.RESOURCE_EXHAUSTED  # no room on that chain now: another chain, or later


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0 or 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end the stream like end-of-sequence (finish "stop"), returned
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not end the stream
    min_tokens: int = 0  # neither end-of-sequence nor stop_token_ids before this many new tokens
    priority: int = 0
    deadline: float | None = None  # event-loop time by which the request must be done
    caller: str = ""  # its token's name (router.auth), "" on an open router
    cache_scope: str = ""  # whose prefix-cache blocks it reads and fills (router/cache_scope.py)

    def log_extra(self, **more: str) -> dict[str, str]:
        """What the request's log lines carry: its id and its caller."""
        return {"request_id": self.request_id, "caller": self.caller, **more}

    def end_ids(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end the stream (once min_tokens are out): stop_token_ids, and the model's end-of-sequence
        tokens unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_ids)

    def sampling(self, eos_ids: frozenset[int]) -> Sampling:
        """What the last stage is told: the request's sampling and processing, and for min_tokens the end tokens
        it suppresses until the position of the min_tokens-th new token."""
        ends = tuple(sorted(self.end_ids(eos_ids)))
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                        min_p=self.min_p, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                        logit_bias=tuple(sorted(self.logit_bias.items())),
                        suppress_ids=ends if self.min_tokens else (),
                        suppress_until=len(self.prompt_ids) + self.min_tokens if self.min_tokens and ends else 0,
                        logprobs=self.logprobs, top_logprobs=self.top_logprobs)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # the tokens returned (a stop string's completing token is not)
    cached_tokens: int  # of prompt_tokens, those the chain that finished had in its stages' prefix caches


@dataclass
class Piece:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "length", "stop" or "eos" on the last piece
    cached_tokens: int = 0  # on the last piece: what the chain that finished had in its prefix caches
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when the request asked
    usage: Usage | None = None  # on the last piece


@dataclass
class GenerationConfig:
    prefill_chunk: int = 256
    """Prompt tokens per pipelined prefill chunk (0: the whole prompt at once); at most the stages'
    --max-batch-tokens, or each chunk runs alone and holds other sessions' decoding back."""
    max_failovers: int = 3
    """How many times one request may move to another chain, or have a stage repaired, when a stage fails
    (0: never)."""
    repair: bool = True
    """When a stage fails mid-stream and another chain has a stage serving the same layers, that stage takes its
    place and only it is rebuilt, from the previous stage's log of what it sent on (router/repair.py); the
    stages keep such logs (--repair-log-tokens) for this; a session whose log was dropped is replayed."""
    wire_dtype: str = field(default="", metadata={"choices": ("", *WIRE_DTYPES)})
    """Hidden states between stages: "" (each stage's own dtype), float32, bfloat16, float16 or int8."""
    step_timeout_s: float = 10.0
    """A stage that answers no step in this long (plus a margin scaled by its reported step time) is
    taken for hung: the stream moves to another chain."""
    max_full_wait_s: float = 30.0
    """When every chain is full, how long a request waits for room (retrying with backoff) before
    RESOURCE_EXHAUSTED; its deadline, if sooner, bounds the wait too."""

    def __post_init__(self) -> None:
        if self.wire_dtype and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--wire-dtype {self.wire_dtype!r}: use one of {', '.join(WIRE_DTYPES)}")
        if not self.prefill_chunk >= 0:
            raise refused(self, "prefill_chunk", "must be >= 0 tokens (0: no chunking)")
        if not self.max_failovers >= 0:
            raise refused(self, "max_failovers", "must be >= 0 (0: a request fails with its first chain)")
        if not self.step_timeout_s > 0:
            raise refused(self, "step_timeout_s", "must be > 0 seconds (the floor of the per-step progress timeout)")
        if not self.max_full_wait_s >= 0:
            raise refused(self, "max_full_wait_s", "must be >= 0 seconds (0: refuse at once when every chain is full)")


async def step_ahead(session: ChainSession, feed: list[int], sampling: Sampling, chunk: int) -> asyncio.Future:
    """The next step on its way before this token goes to the caller: its messages queued, then one turn of the
    event loop, in which the stream's writer sends them (detokenizing and the caller's copy would otherwise come
    first: ~0.3 ms of a 3 ms token on the tiny chain, measured)."""
    ahead = session.step_ahead(feed, sampling=sampling, chunk_size=chunk)
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        ahead.cancel()
        ahead.add_done_callback(_retrieved)
        raise
    return ahead


async def generate(
    req: GenerationRequest, chains: ChainSet, tokenizer, eos_ids: frozenset[int], config: GenerationConfig
) -> AsyncIterator[Piece]:
    """Yields the request's pieces; a failure the caller should see leaves as StatusError."""
    sampling = req.sampling(eos_ids)
    stop_ids = frozenset(req.stop_token_ids)
    ends = req.end_ids(eos_ids)
    progress = Progress(floor_s=config.step_timeout_s)
    text = IncrementalText(tokenizer, req.stop)
    generated: list[int] = []
    tried: set[str] = set()  # chains this request failed on (or found full) since it last waited
    failures, last_error = 0, ""
    backoff = Backoff(req.deadline, config.max_full_wait_s)
    repairs = Repairs(chains, config.repair, req.log_extra())
    max_length = len(req.prompt_ids) + req.max_new_tokens
    while True:
        try:
            chain = chains.pick(exclude=tried, prompt_tokens=len(req.prompt_ids))
        except NoUsableChain:
            if not tried:
                raise
            # Every usable chain failed this request or was full: wait a little, then try them again.
            await backoff.wait(f"every chain is full or failed this request (last: {last_error})")
            tried.clear()
            continue
        chain.in_flight += 1
        chunk = chain.prefill_chunk(config.prefill_chunk)
        try:
            history = req.prompt_ids + generated
            async with ChainSession(chain, max_length, req.request_id, req.deadline, config.wire_dtype,
                                    progress, sampling, keep_output=config.repair,
                                    prefix_ids=history[:-1], history=lambda: req.prompt_ids + generated,
                                    prompt_length=len(req.prompt_ids), cache_scope=req.cache_scope) as session:

                def last(token_ids: list[int], new_text: str, finish: str, logprobs: list[TokenLogprob]) -> Piece:
                    """The stream's last piece, with the usage."""
                    returned = len(generated) - (not token_ids)  # a stop string's token is not returned
                    return Piece(token_ids, new_text, finish, session.attached, logprobs[: len(token_ids)],
                                 Usage(len(req.prompt_ids), returned, session.attached))

                # Everything the chain has not seen yet: the prompt at first (after a failover the
                # prompt plus all tokens so far) past what its stages had cached, then one token per decode step.
                feed = history[session.position:]
                ahead: asyncio.Task | None = None  # the next step, sent before the caller's copy of this token
                try:
                    while True:
                        try:
                            result = await (ahead or session.step(feed, sampling=sampling, chunk_size=chunk))
                        except grpc.aio.AioRpcError as exc:  # one stage failed: repaired if it can be, else replayed
                            if failures >= config.max_failovers or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                                raise
                            result = await repairs.step(session, req.prompt_ids + generated, chunk, exc)
                            if result is None:
                                raise
                            failures += 1
                        ahead = None
                        token = result.token_id
                        generated.append(token)
                        feed = [token]
                        logprobs = [result.logprob] if req.logprobs and result.logprob is not None else []
                        if token in ends and len(generated) > req.min_tokens:  # returned; its text is not
                            yield last([token], text.flush(), "stop" if token in stop_ids else "eos", logprobs)
                            return
                        more = len(generated) < req.max_new_tokens
                        if more and not text.stop:  # no stop string: the text cannot end the stream
                            ahead = await step_ahead(session, feed, sampling, chunk)
                        new_text = text.add([token])
                        if text.stopped:  # the token that completed the stop string is not returned
                            yield last([], new_text, "stop", [])
                            return
                        if not more:
                            yield last([token], new_text + text.flush(), "length", logprobs)
                            return
                        if ahead is None:
                            ahead = await step_ahead(session, feed, sampling, chunk)
                        yield Piece([token], new_text, logprobs=logprobs)
                finally:
                    if ahead is not None:  # the caller left while the next step was on its way
                        ahead.cancel()
                        ahead.add_done_callback(_retrieved)
        except grpc.aio.AioRpcError as exc:
            code, last_error = exc.code(), f"{exc.code().name}: {exc.details()}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StatusError(code, "the call's deadline passed before generation finished") from None
            tried.add(chain.chain_id)
            if code == FULL:  # at open, or mid-stream (a stage preempted the session): replayed later
                metrics.FULL_RETRIES.inc()
                if len(generated) > backoff.progress:  # it moved since it last waited: a new wait, from the start
                    backoff = Backoff(req.deadline, config.max_full_wait_s, progress=len(generated))
                continue
            failures += 1
            if failures > config.max_failovers:
                raise _give_up(code, failures, last_error) from None
            metrics.FAILOVERS.inc()
            if code not in SESSION_FAULTS:
                chains.mark_down(chain, last_error)
            log.warning(
                f"chain {chain.chain_id} failed ({last_error}); moving the stream to another chain and "
                f"replaying {len(req.prompt_ids)} prompt + {len(generated)} generated tokens",
                extra=req.log_extra(chain=chain.chain_id),
            )
        finally:
            chains.release(chain)


def _retrieved(task: asyncio.Task) -> None:
    """A step nobody waits for any more: its failure, if it had one, is read (asyncio would log it)."""
    if not task.cancelled():
        task.exception()


def _give_up(code: grpc.StatusCode, failures: int, last_error: str) -> StatusError:
    """What the caller hears when the request failed on chain after chain."""
    if code in SESSION_FAULTS:
        return StatusError(grpc.StatusCode.INTERNAL,
                           f"the request failed on {failures} chains in a row (last: {last_error}); "
                           "it was not retried further")
    return StatusError(grpc.StatusCode.UNAVAILABLE,
                       f"a stage failed and no other chain could continue (last: {last_error})")


class Backoff:
    """Bounded waits with exponential backoff and jitter, for a request that found every chain full:
    never a busy loop, never past its deadline or max_wait_s in all."""

    first_s = 0.05
    max_s = 1.0

    def __init__(self, deadline: float | None, max_wait_s: float, progress: int = 0):
        self.deadline = deadline
        self.progress = progress  # tokens the request had generated when this wait began
        self.max_wait_s = max_wait_s
        self.waited = 0.0
        self.attempt = 0

    async def wait(self, why: str) -> None:
        left = self.max_wait_s - self.waited
        if self.deadline is not None:
            left = min(left, self.deadline - asyncio.get_running_loop().time())
        if left <= 0:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"no chain had room for this request within {self.waited:.1f}s ({why}); "
                              "retry later or with fewer new tokens")
        delay = min(left, min(self.max_s, self.first_s * 2**self.attempt) * random.uniform(0.5, 1.5))
        await asyncio.sleep(delay)
        self.waited += delay
        self.attempt += 1
