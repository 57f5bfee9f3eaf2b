"""The stagemesh.v1.Router servicer: validates requests (errors say what to change), converts
protobuf at the edge and streams what router.generation produces."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from stagemesh import metrics
from stagemesh.errors import StatusError
from stagemesh.request_limits import (
    MAX_BATCH_REQUESTS,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    InvalidSampling,
    check_processing,
    check_sampling,
    request_id_problem,
)
from stagemesh.router.auth import CALLER, GRANT, NO_LIMITS
from stagemesh.router.cache_scope import cache_scope, caller_identity, grpc_peer_identity
from stagemesh.router.chains import ChainSet, NoUsableChain, kind, width
from stagemesh.router.generation import GenerationConfig, GenerationRequest, generate
from stagemesh.router.priority_queue import AdmissionRefused, PriorityAdmission, priority_class
from stagemesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("stagemesh.router")

FINISH = {
    "length": router_pb2.FINISH_REASON_LENGTH,
    "stop": router_pb2.FINISH_REASON_STOP,
    "eos": router_pb2.FINISH_REASON_EOS,
}


def call_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The event-loop time by which a gRPC call must end (None: the caller set no deadline)."""
    remaining = context.time_remaining()
    return asyncio.get_running_loop().time() + remaining if remaining is not None else None


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, chains: ChainSet, tokenizer, model_config, eos_ids: frozenset[int],
                 config: GenerationConfig, model_name: str, admission: PriorityAdmission):
        self.chains = chains
        self.admission = admission
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_position = model_config.max_position_embeddings
        self.eos_ids = eos_ids
        self.config = config
        self.model_name = model_name

    async def to_generation_request(self, request: router_pb2.GenerateRequest, deadline: float | None,
                                    caller: str = "", *, identity: str,
                                    fill_context: bool = False) -> GenerationRequest:
        """Checks everything a stage would refuse, and the bounds of request_limits, before any work. deadline: the
        event-loop time by which the call must end (None: none); caller: its token's name (router.auth); identity:
        whose prefix-cache blocks it may use (cache_scope.caller_identity).
        fill_context: max_new_tokens 0 asks for the context left after the prompt (the HTTP front, max_tokens
        left out); gRPC callers must ask for at least 1."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if request.request_id and (problem := request_id_problem(request.request_id)):
            raise StatusError(bad, problem)
        if request.prompt and request.token_ids:
            raise StatusError(bad, "set either prompt or token_ids, not both")
        scope = cache_scope(identity, request.cache_salt)
        try:
            check_sampling(request.temperature, request.top_k, request.top_p)
            check_processing(vocab_size=self.vocab_size, min_p=request.min_p,
                             presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                             repetition_penalty=request.repetition_penalty, logit_bias=dict(request.logit_bias),
                             logprobs=request.logprobs, top_logprobs=request.top_logprobs,
                             stop_token_ids=list(request.stop_token_ids))
        except InvalidSampling as exc:
            raise StatusError(bad, str(exc)) from None
        if len(request.stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in request.stop):
            raise StatusError(bad, f"stop: at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_CHARS} characters")
        if request.max_new_tokens < 0 or request.max_new_tokens == 0 and not fill_context:
            raise StatusError(bad, "max_new_tokens must be at least 1")
        if len(request.prompt) > self.max_position * MAX_PROMPT_CHARS_PER_TOKEN:
            raise StatusError(grpc.StatusCode.OUT_OF_RANGE,
                              f"the prompt has {len(request.prompt)} characters, more than the model's context of "
                              f"{self.max_position} tokens can hold: shorten it")
        if len(request.token_ids) >= self.max_position:  # counted before anything copies or scans them
            raise StatusError(grpc.StatusCode.OUT_OF_RANGE, f"the prompt has {len(request.token_ids)} tokens; the "
                              f"model's context is {self.max_position}: shorten it")
        if request.prompt:  # off the event loop: a long text must not stall other callers' streams
            prompt_ids = (await asyncio.to_thread(self.tokenizer, request.prompt, add_special_tokens=True))[
                "input_ids"]
        else:
            prompt_ids = list(request.token_ids)
        if not prompt_ids:
            raise StatusError(bad, "the prompt is empty: set prompt (text) or token_ids")
        outside = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise StatusError(bad, f"token id {outside[0]} is outside the vocabulary 0..{self.vocab_size - 1}")
        if len(prompt_ids) >= self.max_position:
            raise StatusError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_position}: shorten it",
            )
        max_new_tokens = request.max_new_tokens or self.max_position - len(prompt_ids)
        if not request.max_new_tokens and (grant := GRANT.get()) and grant.limits.max_new_tokens is not None:
            max_new_tokens = min(max_new_tokens, grant.limits.max_new_tokens)  # "the most I may ask for"
        if not 0 <= request.min_tokens <= max_new_tokens:
            raise StatusError(bad, f"min_tokens {request.min_tokens}: use 0..max_new_tokens ({max_new_tokens})")
        if len(prompt_ids) + max_new_tokens > self.max_position:
            raise StatusError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.max_position}; ask for at most "
                f"{self.max_position - len(prompt_ids)} new tokens",
            )
        return GenerationRequest(
            request_id=request.request_id or uuid.uuid4().hex[:16],
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p or 1.0,
            # Unset: a fresh one, reported on the first response so that the caller can reproduce the stream.
            seed=request.seed if request.HasField("seed") else secrets.randbits(63),
            stop=tuple(request.stop),
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=dict(request.logit_bias),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            priority=request.priority,
            deadline=deadline,
            caller=caller,
            cache_scope=scope,
        )

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Waits for admission, then streams; every failure the caller can act on leaves as StatusError."""
        extra = req.log_extra()
        cls = priority_class(req.priority)
        arrived = time.perf_counter()
        grant = GRANT.get()
        try:
            ticket = await self.admission.acquire(req.priority, req.deadline, req.caller,
                                                  grant.limits if grant else NO_LIMITS, len(req.prompt_ids),
                                                  req.max_new_tokens)
        except AdmissionRefused as exc:
            log.warning(exc.message, extra=extra)
            metrics.count_request(exc.code.name, req.caller)
            raise
        metrics.QUEUE_WAIT.labels(cls).observe(time.perf_counter() - arrived)
        metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
        status = "CANCELLED"
        first = seed_untold = True
        last_token_at: float | None = None
        generated = 0
        limit_s = self.admission.config.max_stream_seconds
        ends = asyncio.get_running_loop().time() + limit_s if limit_s else None
        log.info(f"generate: {len(req.prompt_ids)} prompt tokens, up to {req.max_new_tokens} new, "
                 f"priority {req.priority}", extra=extra)
        try:
            # Closed here, not when the collector gets to it: a stream's next step is on its way as it yields.
            async with contextlib.aclosing(generate(req, self.chains, self.tokenizer, self.eos_ids,
                                                    self.config)) as pieces:
                while (piece := await self._next_piece(pieces, ends, limit_s)) is not None:
                    generated += len(piece.token_ids)
                    now = time.perf_counter()
                    if first:
                        metrics.TIME_TO_FIRST_TOKEN.labels(cls).observe(now - arrived)
                        first = False
                    if piece.token_ids:
                        metrics.observe_inter_token(None if last_token_at is None else now - last_token_at,
                                                    len(piece.token_ids), cls)
                        last_token_at = now
                    metrics.TOKENS.inc(len(piece.token_ids))
                    response = router_pb2.GenerateResponse(
                        token_ids=piece.token_ids,
                        text=piece.text,
                        finish_reason=FINISH.get(piece.finish_reason, router_pb2.FINISH_REASON_UNSPECIFIED),
                        request_id=req.request_id,
                        cached_tokens=piece.cached_tokens,
                    )
                    if seed_untold:
                        response.seed, seed_untold = req.seed, False
                    for lp in piece.logprobs:
                        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                                              top=[router_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
                    if piece.usage is not None:
                        response.usage.prompt_tokens = piece.usage.prompt_tokens
                        response.usage.completion_tokens = piece.usage.completion_tokens
                        response.usage.cached_tokens = piece.usage.cached_tokens
                    yield response
            status = "OK"
            metrics.REQUEST_SECONDS.labels(cls).observe(time.perf_counter() - arrived)
        except NoUsableChain as exc:
            log.warning(str(exc), extra=extra)
            status = "UNAVAILABLE"
            raise StatusError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except StatusError as exc:
            status = exc.code.name
            log.warning(f"generate failed: {exc.code.name}: {exc.message}", extra=extra)
            raise
        finally:
            self.admission.release(ticket, len(req.prompt_ids) + generated)
            metrics.count_request(status, req.caller)

    @staticmethod
    async def _next_piece(pieces: AsyncIterator, ends: float | None, limit_s: float):
        """The stream's next piece, None at its end; StatusError once it has run past --max-stream-seconds (ends).
        RESOURCE_EXHAUSTED, not DEADLINE_EXCEEDED: the caller's own deadline did not pass, the router's share of
        time per stream did; retrying with a longer deadline would not help, asking for fewer tokens would."""
        try:
            async with asyncio.timeout_at(ends):
                return await anext(pieces)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the stream ran past this router's --max-stream-seconds {limit_s:g}: ask for fewer "
                              "new tokens") from None

    async def Generate(self, request, context):
        # Closed with the call, not when collected: _stream gives its admission slot back then.
        req = await self.to_generation_request(request, call_deadline(context), CALLER.get(),
                                               identity=caller_identity(GRANT.get(), grpc_peer_identity(context)))
        async with contextlib.aclosing(self._stream(req)) as responses:
            async for response in responses:
                yield response

    async def GenerateBatch(self, request, context):
        if not 0 < len(request.requests) <= MAX_BATCH_REQUESTS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"requests has {len(request.requests)} entries: send 1..{MAX_BATCH_REQUESTS} per call")
        # Bounded: a caller that reads slowly holds its prompts' streams back instead of the router
        # buffering their tokens.
        out: asyncio.Queue[router_pb2.GenerateBatchResponse | None] = asyncio.Queue(maxsize=64)
        abandoned = False  # the call ended: nobody reads `out` any more
        identity = caller_identity(GRANT.get(), grpc_peer_identity(context))

        async def run(index: int, sub: router_pb2.GenerateRequest) -> None:
            try:
                req = await self.to_generation_request(sub, call_deadline(context), CALLER.get(), identity=identity)
                async with contextlib.aclosing(self._stream(req)) as responses:
                    async for response in responses:
                        await out.put(router_pb2.GenerateBatchResponse(index=index, response=response))
            except StatusError as exc:  # one prompt's refusal is its own entry; the others go on
                await out.put(router_pb2.GenerateBatchResponse(
                    index=index, error_code=exc.code.value[0], error_message=f"request {index}: {exc.message}"))
            except Exception:  # a bug: this prompt gets an entry all the same, never a silent drop
                log.exception(f"GenerateBatch entry {index} failed",
                              extra={"request_id": sub.request_id, "caller": CALLER.get()})
                await out.put(router_pb2.GenerateBatchResponse(
                    index=index, error_code=grpc.StatusCode.INTERNAL.value[0],
                    error_message=f"request {index}: internal error in the router; it logged it"))
            finally:
                if not abandoned:  # a full queue nobody reads would hold this task forever
                    await out.put(None)  # this prompt is done

        # Each prompt runs as its own stream; the chain picker spreads them over all usable chains.
        tasks = [asyncio.ensure_future(run(i, sub)) for i, sub in enumerate(request.requests)]
        running = len(tasks)
        try:
            while running:
                item = await out.get()
                if item is None:
                    running -= 1
                else:
                    yield item
        finally:
            abandoned = True
            for t in tasks:
                t.cancel()

    async def GetModelInfo(self, request, context):
        usable = sorted({c.fingerprint for c in self.chains.usable() if c.fingerprint})
        return router_pb2.ModelInfo(
            model=self.model_name,
            context_length=self.max_position,
            vocab_size=self.vocab_size,
            fingerprint=",".join(usable),
            chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
            eos_token_ids=sorted(self.eos_ids),
        )

    async def ListChains(self, request, context):
        return router_pb2.ListChainsResponse(
            model=self.model_name,
            plan=self.chains.plan,
            chains=[
                router_pb2.Chain(
                    chain_id=c.chain_id,
                    healthy=c.healthy,
                    in_flight=c.in_flight,
                    fingerprint=c.fingerprint,
                    kind=kind(c),
                    tp_width=width(c),
                    length_class=self.chains.length_class_of(c),
                    problem=c.problem,
                    stages=[router_pb2.StageRef(address=s.address, layer_start=s.layer_start,
                                                layer_end=s.layer_end) for s in c.stages],
                )
                for c in self.chains.chains
            ],
        )
