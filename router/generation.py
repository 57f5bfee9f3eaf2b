"""One request's life in the router: pick a chain, prefill, decode token by token, stop, and
move to another chain (replaying what the dead one had) when a stage dies mid-stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from router.chain_client import ChainSession
from router.chains import ChainSet, NoUsableChain
from router.detokenizer import IncrementalText
from stagemesh import metrics
from stagemesh.config_flags import refused
from stagemesh.tensor_codec import WIRE_DTYPES
from stagemesh.v1 import stage_pb2

log = logging.getLogger("stagemesh.router")

# A stage that died or cannot take the session: the request can continue on another chain.
FAILOVER_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
})


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
    priority: int = 0
    deadline: float | None = None  # event-loop time by which the request must be done


@dataclass
class Piece:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "length", "stop" or "eos" on the last piece


@dataclass
class GenerationConfig:
    prefill_chunk: int = 256
    """Prompt tokens per pipelined prefill chunk (0: the whole prompt at once); at most the stages'
    --max-batch-tokens, or each chunk runs alone and holds other sessions' decoding back."""
    max_failovers: int = 3
    """How many times one request may move to another chain when a stage fails (0: never)."""
    wire_dtype: str = field(default="", metadata={"choices": ("", *WIRE_DTYPES)})
    """Hidden states between stages: "" (each stage's own dtype), float32, bfloat16, float16 or int8."""

    def __post_init__(self) -> None:
        if self.wire_dtype and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--wire-dtype {self.wire_dtype!r}: use one of {', '.join(WIRE_DTYPES)}")
        if not self.prefill_chunk >= 0:
            raise refused(self, "prefill_chunk", "must be >= 0 tokens (0: no chunking)")
        if not self.max_failovers >= 0:
            raise refused(self, "max_failovers", "must be >= 0 (0: a request fails with its first chain)")


async def generate(
    req: GenerationRequest, chains: ChainSet, tokenizer, eos_ids: frozenset[int], config: GenerationConfig
) -> AsyncIterator[Piece]:
    sampling = stage_pb2.SamplingParams(
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed
    )
    text = IncrementalText(tokenizer, req.stop)
    generated: list[int] = []
    tried: set[str] = set()
    max_length = len(req.prompt_ids) + req.max_new_tokens
    while True:
        try:
            chain = chains.pick(exclude=tried)
        except NoUsableChain:
            chain = chains.pick()  # every usable chain was tried: the least loaded again
        chain.in_flight += 1
        try:
            async with ChainSession(chain, max_length, req.request_id, req.deadline, config.wire_dtype) as session:
                # Everything the chain has not seen yet: the prompt at first (after a failover the
                # prompt plus all tokens so far), then one token per decode step.
                feed = req.prompt_ids + generated
                while True:
                    response = await session.step(feed, sampling=sampling, chunk_size=config.prefill_chunk)
                    token = response.token_id
                    generated.append(token)
                    feed = [token]
                    if token in eos_ids:
                        yield Piece([token], text.flush(), "eos")
                        return
                    new_text = text.add([token])
                    if text.stopped:
                        yield Piece([token], new_text, "stop")
                        return
                    if len(generated) >= req.max_new_tokens:
                        yield Piece([token], new_text + text.flush(), "length")
                        return
                    yield Piece([token], new_text)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in FAILOVER_CODES or len(tried) >= config.max_failovers:
                raise
            tried.add(chain.chain_id)
            metrics.FAILOVERS.inc()
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                chains.mark_down(chain, f"{exc.code().name}: {exc.details()}")
            log.warning(
                f"chain {chain.chain_id} failed ({exc.code().name}: {exc.details()}); moving the stream to "
                f"another chain and replaying {len(req.prompt_ids)} prompt + {len(generated)} generated tokens",
                extra={"request_id": req.request_id, "chain": chain.chain_id},
            )
        finally:
            chains.release(chain)
