"""The stagemesh.v1.Stage servicer: converts protobuf at the edge, validates, and hands steps to
the batcher. The model code never sees a protobuf message. Handlers refuse by raising (StatusError,
or a domain error of ERROR_CODES); the stage server's one StatusInterceptor answers the caller."""

from __future__ import annotations

import logging
import resource
import time

import grpc
import torch

from stage_server.batcher import BatcherStopped, OutOfMemory, StepBatcher, StepRequest
from stage_server.kv_pool import PoolExhausted
from stage_server.model import StageModel
from stage_server.sampling import Sampling
from stage_server.sessions import (
    Session,
    SessionError,
    SessionExists,
    SessionTable,
    SessionTooLong,
    UnknownSession,
    short_id,
)
from stagemesh import metrics, tensor_codec
from stagemesh.errors import ErrorCodes, StatusError, request_id_of
from stagemesh.request_limits import InvalidSampling
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.stage")
_WIRE_IN, _WIRE_OUT = metrics.WIRE_BYTES.labels("in"), metrics.WIRE_BYTES.labels("out")


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM, unlike ru_maxrss, is not inherited across exec
    from a fat parent process."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


ERROR_CODES: ErrorCodes = {
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    SessionTooLong: grpc.StatusCode.OUT_OF_RANGE,
    SessionError: grpc.StatusCode.INVALID_ARGUMENT,
    PoolExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    OutOfMemory: grpc.StatusCode.RESOURCE_EXHAUSTED,
    tensor_codec.CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidSampling: grpc.StatusCode.INVALID_ARGUMENT,
    BatcherStopped: grpc.StatusCode.UNAVAILABLE,
}
"""The stage's domain errors as the caller sees them (the stage server's StatusInterceptor reads
this); anything else a handler raises is a bug: INTERNAL, logged, its text kept from the caller.
A step that failed alone in its pass (batcher.StepFailed) is such a bug, of that step only."""


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, as far as session ownership goes: the caller's connection. A router's channel
    to a stage is one connection, so its OpenSession, Forward and CloseSession calls share it; a
    session id seen elsewhere (a log, a capture) is of no use from any other connection."""
    return context.peer()


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(self, model: StageModel, sessions: SessionTable, batcher: StepBatcher, model_name: str,
                 fingerprint: str, address: str = ""):
        self.address = address  # in every log line, with the request id: a request is followed across hops
        self.model = model
        self.sessions = sessions
        self.batcher = batcher
        self.model_name = model_name
        self.fingerprint = fingerprint

    def _extra(self, session_id: str, request_id: str) -> dict[str, str]:
        return {"session_id": short_id(session_id), "request_id": request_id, "stage": self.address}

    async def OpenSession(self, request, context):
        request_id = request.request_id or request_id_of(context)
        self.sessions.open(request.session_id, request.max_length, request_id, caller_of(context))
        log.info("session opened", extra=self._extra(request.session_id, request_id))
        return stage_pb2.OpenSessionResponse(session_id=request.session_id)

    async def CloseSession(self, request, context):
        if not self.sessions.close(request.session_id, caller_of(context)):
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no open session {request.session_id!r}")
        return stage_pb2.CloseSessionResponse()

    async def Forward(self, request_iterator, context):
        caller = caller_of(context)
        touched: set[str] = set()
        timing = self.batcher.timing
        try:
            async for request in request_iterator:
                t0 = time.perf_counter()
                _WIRE_IN.inc(request.ByteSize())
                session = self.sessions.get(request.session_id, caller)  # only the opener's, else NOT_FOUND
                touched.add(session.session_id)
                step = self._to_step(request, session)
                decode = step.length == 1
                timing.since("wire_decode", t0, decode)
                result = await self.batcher.submit(step)
                t0 = time.perf_counter()
                response = stage_pb2.ForwardResponse(session_id=request.session_id)
                if result.hidden is not None:  # written in place: no second message, no CopyFrom
                    tensor_codec.encode_hidden_into(response.hidden, result.hidden, request.wire_dtype)
                if result.token_id is not None:
                    response.token_id = result.token_id
                if result.logits is not None:
                    tensor_codec.encode_into(response.logits, result.logits)
                _WIRE_OUT.inc(response.ByteSize())
                timing.since("encode", t0, decode)
                timing.decode_steps += decode
                yield response
        finally:
            # The stream is the session's lifeline: when it ends (done, cancelled, caller gone),
            # nothing will step these sessions again.
            for sid in touched:
                session = self.sessions.sessions.get(sid)
                if session is not None and self.sessions.close(sid, caller):
                    log.info("session closed with its stream", extra=self._extra(sid, session.request_id))

    def _to_step(self, request: stage_pb2.ForwardRequest, session: Session) -> StepRequest:
        model, args = self.model, self.model.args
        which = request.WhichOneof("input")
        if model.is_first:
            if which != "token_ids":
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  "the first stage takes token_ids, not hidden states")
            inputs = tensor_codec.decode(request.token_ids)
            if inputs.dtype not in (torch.int64, torch.int32) or inputs.dim() != 1:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"token_ids must be a 1-D int64/int32 tensor, got {request.token_ids.dtype} "
                                  f"{list(inputs.shape)}")
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= args.vocab_size):
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"token id outside the vocabulary 0..{args.vocab_size - 1}")
            inputs = inputs.long()
        else:
            if which != "hidden":
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"stage {model.layer_start}:{model.layer_end} takes hidden states, not token ids")
            inputs = tensor_codec.decode(request.hidden)
            if not inputs.is_floating_point():
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"hidden states must be float32, bfloat16, float16 or int8 with row_scale, "
                                  f"got {request.hidden.dtype}")
            if inputs.dim() != 2 or inputs.shape[1] != args.hidden_size:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"hidden states must have shape [tokens, {args.hidden_size}], "
                                  f"got {list(inputs.shape)}")
        n = inputs.shape[0]
        if n == 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a step needs at least one token")
        cache = session.cache
        if request.start != cache.length:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"step starts at position {request.start} but session {session.session_id} "
                              f"holds positions 0..{cache.length - 1}; the next step must start at {cache.length}")
        if request.start + n > cache.capacity:
            raise StatusError(grpc.StatusCode.OUT_OF_RANGE,
                              f"step would reach position {request.start + n}, past the session's max_length "
                              f"{cache.capacity}")
        sampling = None
        if model.is_last and not request.skip_sample:
            p = request.sampling
            sampling = Sampling(p.temperature, p.top_k, p.top_p or 1.0, p.seed)  # checks the bounds
        return StepRequest(session, request.start, inputs, sampling, request.return_logits)

    async def Info(self, request, context):
        model, args = self.model, self.model.args
        weight_bytes = sum(p.nbytes for p in model.parameters())
        return stage_pb2.StageInfo(
            model=self.model_name,
            family=args.family,
            layer_start=model.layer_start,
            layer_end=model.layer_end,
            num_layers=args.num_layers,
            is_first=model.is_first,
            is_last=model.is_last,
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            hidden_size=args.hidden_size,
            vocab_size=args.vocab_size,
            max_position=args.max_position,
            weight_bytes=weight_bytes,
            peak_rss_bytes=peak_rss_bytes(),
            open_sessions=len(self.sessions),
            kv_used_bytes=self.sessions.pool.used_bytes,
            kv_capacity_bytes=self.sessions.pool.capacity_bytes,
            queued_steps=self.batcher.queued,
            step_ms=self.batcher.step_ms,
            load_s=model.load_s,
            max_batch_tokens=self.batcher.config.max_batch_tokens,
            fingerprint=self.fingerprint,
            decode_phase_seconds=self.batcher.timing.decode_seconds,
            decode_steps=self.batcher.timing.decode_steps,
        )
