"""The stagemesh.v1.Router servicer: validates requests (errors say what to change), converts
protobuf at the edge and streams what router.generation produces."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from router.chains import ChainSet, NoUsableChain
from router.generation import GenerationConfig, GenerationRequest, generate
from router.priority_queue import AdmissionRefused, PriorityAdmission, priority_class
from stagemesh import metrics
from stagemesh.errors import StatusError
from stagemesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("stagemesh.router")

FINISH = {
    "length": router_pb2.FINISH_REASON_LENGTH,
    "stop": router_pb2.FINISH_REASON_STOP,
    "eos": router_pb2.FINISH_REASON_EOS,
}


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

    def to_generation_request(self, request: router_pb2.GenerateRequest, context) -> GenerationRequest:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if request.prompt and request.token_ids:
            raise StatusError(bad, "set either prompt or token_ids, not both")
        if request.prompt:
            prompt_ids = self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        else:
            prompt_ids = list(request.token_ids)
        if not prompt_ids:
            raise StatusError(bad, "the prompt is empty: set prompt (text) or token_ids")
        outside = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise StatusError(bad, f"token id {outside[0]} is outside the vocabulary 0..{self.vocab_size - 1}")
        if request.max_new_tokens <= 0:
            raise StatusError(bad, "max_new_tokens must be at least 1")
        if len(prompt_ids) >= self.max_position:
            raise StatusError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_position}: shorten it",
            )
        if len(prompt_ids) + request.max_new_tokens > self.max_position:
            raise StatusError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                f"model's context of {self.max_position}; ask for at most "
                f"{self.max_position - len(prompt_ids)} new tokens",
            )
        if request.temperature < 0 or request.top_k < 0 or not 0 <= request.top_p <= 1:
            raise StatusError(bad, "sampling needs temperature >= 0, top_k >= 0 and 0 <= top_p <= 1")
        if any(not s for s in request.stop):
            raise StatusError(bad, "stop strings must not be empty")
        remaining = context.time_remaining()
        deadline = asyncio.get_running_loop().time() + remaining if remaining is not None else None
        return GenerationRequest(
            request_id=request.request_id or uuid.uuid4().hex[:16],
            prompt_ids=prompt_ids,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p or 1.0,
            seed=request.seed,
            stop=tuple(request.stop),
            priority=request.priority,
            deadline=deadline,
        )

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Waits for admission, then streams; every failure the caller can act on leaves as StatusError."""
        extra = {"request_id": req.request_id}
        cls = priority_class(req.priority)
        arrived = time.perf_counter()
        try:
            await self.admission.acquire(req.priority, req.deadline)
        except AdmissionRefused as exc:
            log.warning(exc.message, extra=extra)
            metrics.REQUESTS.labels(exc.code.name).inc()
            raise
        metrics.QUEUE_WAIT.labels(cls).observe(time.perf_counter() - arrived)
        status = "CANCELLED"
        first = True
        log.info(f"generate: {len(req.prompt_ids)} prompt tokens, up to {req.max_new_tokens} new, "
                 f"priority {req.priority}", extra=extra)
        try:
            async for piece in generate(req, self.chains, self.tokenizer, self.eos_ids, self.config):
                if first:
                    metrics.TIME_TO_FIRST_TOKEN.labels(cls).observe(time.perf_counter() - arrived)
                    first = False
                metrics.TOKENS.inc(len(piece.token_ids))
                yield router_pb2.GenerateResponse(
                    token_ids=piece.token_ids,
                    text=piece.text,
                    finish_reason=FINISH.get(piece.finish_reason, router_pb2.FINISH_REASON_UNSPECIFIED),
                    request_id=req.request_id,
                )
            status = "OK"
        except NoUsableChain as exc:
            log.warning(str(exc), extra=extra)
            status = "UNAVAILABLE"
            raise StatusError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            status = code.name
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StatusError(code, "the call's deadline passed before generation finished") from None
            log.warning(f"stage error: {code.name}: {exc.details()}", extra=extra)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise StatusError(code, f"every chain is full: {exc.details()}") from None
            if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
                code = grpc.StatusCode.UNAVAILABLE
            raise StatusError(code, f"a stage failed and no other chain could continue: {exc.details()}") from None
        finally:
            self.admission.release()
            metrics.REQUESTS.labels(status).inc()

    async def Generate(self, request, context):
        # Closed with the call, not when collected: _stream gives its admission slot back then.
        async with contextlib.aclosing(self._stream(self.to_generation_request(request, context))) as responses:
            async for response in responses:
                yield response

    async def GenerateBatch(self, request, context):
        if not request.requests:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "requests is empty")
        out: asyncio.Queue[router_pb2.GenerateBatchResponse | None] = asyncio.Queue()

        async def run(index: int, sub: router_pb2.GenerateRequest) -> None:
            try:
                req = self.to_generation_request(sub, context)
                async for response in self._stream(req):
                    out.put_nowait(router_pb2.GenerateBatchResponse(index=index, response=response))
            except StatusError as exc:  # one prompt's refusal is its own entry; the others go on
                out.put_nowait(router_pb2.GenerateBatchResponse(
                    index=index, error_code=exc.code.value[0], error_message=f"request {index}: {exc.message}"))
            finally:
                out.put_nowait(None)  # this prompt is done

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
            for t in tasks:
                t.cancel()

    async def ListChains(self, request, context):
        return router_pb2.ListChainsResponse(
            model=self.model_name,
            plan=self.chains.plan,
            chains=[
                router_pb2.Chain(
                    chain_id=c.chain_id,
                    healthy=c.healthy,
                    in_flight=c.in_flight,
                    stages=[router_pb2.StageRef(address=s.address, layer_start=s.layer_start,
                                                layer_end=s.layer_end) for s in c.stages],
                )
                for c in self.chains.chains
            ],
        )
