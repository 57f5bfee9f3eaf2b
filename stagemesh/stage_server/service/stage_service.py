"""The stagemesh.v1.Stage servicer: converts protobuf at the edge, validates, and hands steps to
the batcher. The model code never sees a protobuf message. Handlers refuse by raising (StatusError,
or a domain error of ERROR_CODES); the stage server's one StatusInterceptor answers the caller."""

from __future__ import annotations

import asyncio
import logging
import resource
import time

import grpc
import torch

from stagemesh import metrics, tensor_codec
from stagemesh.errors import ErrorCodes, StatusError, request_id_of
from stagemesh.processes import peak_rss_bytes
from stagemesh.request_limits import InvalidSampling
from stagemesh.stage_server.cpu import packed_weights
from stagemesh.stage_server.engine.batcher import BatcherStopped, OutOfMemory, StepBatcher, StepRequest, StepResult
from stagemesh.stage_server.engine.kv_pool import PoolExhausted
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.step_inputs import decode_inputs, step_tokens
from stagemesh.stage_server.service import relay_stream
from stagemesh.stage_server.service.backpressure import Budget, QueueConfig, step_bytes
from stagemesh.stage_server.service.callers import caller_of, prefix_domain
from stagemesh.stage_server.service.forwarding import Links, Route
from stagemesh.stage_server.service.output_log import readable
from stagemesh.stage_server.service.sampling_params import add_logprobs, history_of, sampling_of, step_sampling
from stagemesh.stage_server.service.session_stream import end_streams, serve
from stagemesh.stage_server.service.sessions import (
    Session,
    SessionError,
    SessionExists,
    SessionTable,
    SessionTooLong,
    UnknownSession,
    short_id,
)
from stagemesh.tls import Tls
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.stage")
_WIRE_IN, _WIRE_OUT = metrics.WIRE_BYTES.labels("in"), metrics.WIRE_BYTES.labels("out")


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


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(self, model: StageModel, sessions: SessionTable, batcher: StepBatcher, model_name: str,
                 fingerprint: str, address: str = "", tls: Tls | None = None, insecure: bool = False,
                 queues: QueueConfig | None = None):
        self.address = address  # in every log line, with the request id: a request is followed across hops
        self.model = model
        self.sessions = sessions
        self.batcher = batcher
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.queues = queues or QueueConfig()
        self.budgets: set[Budget] = set()  # the incoming streams' (Stage/Info streams_waiting)
        # To next stages, with the mesh's TLS; a session that closes leaves them.
        self.links = Links(tls, self._link_broken, self._relay_refused, insecure, self.queues)
        sessions.on_close = self.links.forget

    async def close(self) -> None:
        """Ends the links to next stages and the routers' Sessions streams (the slice is swapped or the stage stops)."""
        end_streams(self)
        await self.links.close()

    def _extra(self, session_id: str, request_id: str) -> dict[str, str]:
        return {"session_id": short_id(session_id), "request_id": request_id, "stage": self.address}

    async def OpenSession(self, request, context):
        request_id = request.request_id or request_id_of(context)
        sampling = sampling_of(request.sampling, self.model.args.vocab_size) if request.HasField("sampling") else None
        history = history_of(request, sampling, self.model)
        if request.wire_dtype and request.wire_dtype not in tensor_codec.WIRE_DTYPES:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"wire_dtype {request.wire_dtype!r}: use one of {', '.join(tensor_codec.WIRE_DTYPES)}")
        if request.next_address and self.model.is_last:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the last stage has no next stage to forward to")
        if request.next_address:
            self.links.check(request.next_address)
        route = Route(request.next_address, request.next_key, request.upstream_key, sampling, request.wire_dtype,
                      request.previous_address, request.repairable)
        session = self.sessions.open(request.session_id, request.max_length, request_id, caller_of(context), route,
                                     keep_output=request.keep_output and not self.model.is_last,
                                     prefix_ids=list(request.prefix_ids),
                                     prefix_salt=f"{prefix_domain(context)}|{request.prefix_salt}")
        session.history = history
        attached = session.cache.attached
        log.info(f"session opened{f', {attached} positions from the prefix cache' if attached else ''}",
                 extra=self._extra(request.session_id, request_id))
        return stage_pb2.OpenSessionResponse(session_id=request.session_id, cached_positions=attached)

    async def CloseSession(self, request, context):
        if not self.sessions.close(request.session_id, caller_of(context)):
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no open session {request.session_id!r}")
        return stage_pb2.CloseSessionResponse()

    async def _run(self, request: stage_pb2.ForwardRequest, session: Session, inputs: torch.Tensor | None = None,
                   t0: float | None = None) -> tuple[StepResult, bool]:
        """Runs a step: its input decoded (unless already, from t0 on) and checked, then its pass. Times the wire
        decode (step_timing); returns the result and whether it was a decode step (one token)."""
        t0 = time.perf_counter() if t0 is None else t0
        step = self._checked(request, session, decode_inputs(self.model, request) if inputs is None else inputs, t0)
        decode = step.length == 1
        result = await self.batcher.submit(step)
        self._ran(request, session, result, decode)
        return result, decode

    def _checked(self, request: stage_pb2.ForwardRequest, session: Session, inputs: torch.Tensor,
                 t0: float) -> StepRequest:
        """The step, checked against its session; the wire decode timed from t0 (step_timing)."""
        step = self._to_step(request, session, inputs)
        self.batcher.timing.since("wire_decode", t0, step.length == 1)
        return step

    def _ran(self, request: stage_pb2.ForwardRequest, session: Session, result: StepResult, decode: bool) -> None:
        self.batcher.timing.decode_steps += decode
        session.route.stepped.set()

    def _response(self, session: Session, result: StepResult) -> stage_pb2.ForwardResponse:
        """The last stage's answer to its router: the sampled token (and logits)."""
        response = stage_pb2.ForwardResponse(session_id=session.session_id)
        if result.token_id is not None:
            response.token_id = result.token_id
        add_logprobs(response, result.logprobs)
        if result.logits is not None:
            tensor_codec.encode_into(response.logits, result.logits)
        return response

    def _send_on(self, session: Session, request: stage_pb2.ForwardRequest, result: StepResult,
                       decode: bool) -> None:
        """A forwarding session's output, to its next stage (sent once per step, with the step's flags)."""
        t0 = time.perf_counter()
        route = session.route
        hidden = result.hidden
        onward = self.links.step(route.next_address, session.session_id, hidden.numel() * hidden.element_size())
        onward.start, onward.hop_key = request.start, route.next_key
        onward.skip_sample, onward.return_logits, onward.ack = request.skip_sample, request.return_logits, request.ack
        tensor_codec.encode_hidden_into(onward.hidden, hidden, request.wire_dtype or route.wire_dtype)
        self.batcher.timing.since("encode", t0, decode)

    async def Sessions(self, request_iterator, context, admit=None):  # stage_server/service/session_stream.py
        async for events in serve(self, request_iterator, context, ERROR_CODES, admit):
            yield events

    async def Relay(self, request_iterator, context):  # stage_server/service/relay_stream.py
        async for status in relay_stream.serve(self, request_iterator):
            yield status

    def relay(self, session: Session, request: stage_pb2.ForwardRequest, running: set[asyncio.Task],
              budget: Budget) -> None:
        """A step relayed by the previous stage, or sent by a router on its Sessions stream (checked on arrival:
        step_inputs.check_inputs), run in its session's order on a task of its own (kept in running, counted in the
        stream's budget until it ends), decoded only then; its result goes on to the next stage (once its link has
        room), or (last stage) to the router, on the Sessions stream that opened the session. The lone session of a
        stage runs its decode step at once, here, when the batcher would run it alone and inline anyway: the task,
        the queue, the future and two loop turns cost ~0.1 ms a stage of a tiny model's ~1 ms step (measured)."""
        route = session.route
        if step_tokens(request) == 1 and len(self.sessions) == 1 and not route.pending \
                and self.batcher.can_run_now() and (not route.forwards or self.links.has_room(route.next_address)):
            try:
                t0 = time.perf_counter()
                step = self._checked(request, session, decode_inputs(self.model, request), t0)
                result = self.batcher.run_now(step)
                self._ran(request, session, result, True)
                self._pass_on(session, request, result, True)
            except Exception as exc:
                self._fail(session.session_id, exc)
            return
        nbytes = step_bytes(request)
        budget.take(nbytes)
        route.in_order(self._relayed_step(session, request, budget, nbytes), running)

    async def _relayed_step(self, session: Session, request: stage_pb2.ForwardRequest, budget: Budget,
                            nbytes: int) -> None:
        try:
            async with session.route.order:
                if session.route.forwards and not session.closed:
                    await self.links.room(session.route.next_address)  # the next stage lags: wait, holding the rest
                if session.closed:
                    return
                result, decode = await self._run(request, session)
                self._pass_on(session, request, result, decode)
        except Exception as exc:
            self._fail(session.session_id, exc)
        finally:
            budget.give(nbytes)

    def _pass_on(self, session: Session, request: stage_pb2.ForwardRequest, result: StepResult,
                 decode: bool) -> None:
        """A relayed step's result, to the next stage or (last stage) to its router."""
        if session.route.forwards:
            self._send_on(session, request, result, decode)
        elif result.token_id is not None or result.logits is not None:
            t0 = time.perf_counter()
            response = self._response(session, result)
            _WIRE_OUT.inc(response.ByteSize())
            self.batcher.timing.since("encode", t0, decode)
            session.route.deliver(response)
        elif request.ack:  # a prefill chunk through the whole chain: its router sends the next (prefill_window.py)
            session.route.deliver(stage_pb2.ForwardResponse(session_id=session.session_id, ack=True))

    def _fail(self, session_id: str, exc: BaseException, link: bool = False) -> None:
        """Ends a session here for its fault: its router hears it on its Sessions stream. A repairable
        session outlives a broken link (link): its router hears the dead stage itself, and repairs or closes it."""
        session = self.sessions.sessions.get(session_id)
        if session is None or (link and session.route.repairable):
            return
        session.route.deliver(exc)
        self.sessions.close(session_id)
        log.info(f"session failed: {exc}", extra=self._extra(session_id, session.request_id))

    def _link_broken(self, address: str, carried: set[str], code: grpc.StatusCode, details: str) -> None:
        for sid in carried:
            self._fail(sid, StatusError(code, f"next stage {address} unreachable: {details}"), link=True)

    def _relay_refused(self, address: str, status: stage_pb2.RelayStatus) -> None:
        """A relayed step the next stage did not take. NOT_FOUND: it no longer holds the session (it stopped or
        swapped its slice, or its router's stream to it ended), which is that stage's failure, as a broken link is:
        a repairable session stays open here for its router, which hears that stage itself and re-points this one."""
        code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
        lost = code == grpc.StatusCode.NOT_FOUND
        session = self.sessions.sessions.get(status.session_id)
        if lost and session is not None and session.route.repairable:
            log.info(f"next stage {address} refused a relayed step ({status.details}): the session stays open "
                     "for its router's repair", extra=self._extra(session.session_id, session.request_id))
        self._fail(status.session_id, StatusError(code, f"next stage {address}: {status.details}"), link=lost)

    def _to_step(self, request: stage_pb2.ForwardRequest, session: Session, inputs: torch.Tensor) -> StepRequest:
        n, cache = inputs.shape[0], session.cache
        if cache.attached and cache.length == cache.attached and 0 <= request.start < cache.length:
            # Its first step, and the chain's other stages had fewer positions cached: those past it go.
            self.sessions.pool.rewind(cache, request.start)
        if request.start != cache.length:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"step starts at position {request.start} but session {session.session_id} "
                              f"holds positions 0..{cache.length - 1}; the next step must start at {cache.length}")
        if request.start + n > cache.capacity:
            raise StatusError(grpc.StatusCode.OUT_OF_RANGE,
                              f"step would reach position {request.start + n}, past the session's max_length "
                              f"{cache.capacity}")
        if self.model.is_first and request.start < len(cache.claimed):  # its blocks hold the tokens they claim
            self.sessions.pool.check_tokens(cache, request.start, inputs.tolist())
        sampling = None
        if self.model.is_last and not request.skip_sample:
            sampling = step_sampling(request, session.route.sampling, session.history, self.model.args.vocab_size)
        return StepRequest(session, request.start, inputs, sampling, request.return_logits)

    async def ReadOutput(self, request, context):
        session = self.sessions.get(request.session_id, caller_of(context))  # only the opener's, else NOT_FOUND
        for start, rows in readable(session.output, request.start, request.end, request.chunk_tokens):
            chunk = stage_pb2.OutputChunk(start=start)
            tensor_codec.encode_hidden_into(chunk.hidden, rows, session.route.wire_dtype)
            yield chunk

    async def Info(self, request, context):
        model, args = self.model, self.model.args
        weight_bytes = sum(p.nbytes for p in model.parameters()) - packed_weights.padding_bytes(model)
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
            peak_rss_bytes=peak_rss_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            open_sessions=len(self.sessions),
            kv_used_bytes=self.sessions.pool.used_bytes,
            kv_capacity_bytes=self.sessions.pool.capacity_bytes,
            kv_block_size=self.sessions.pool.block_size,
            kv_blocks_used=self.sessions.pool.blocks_used,
            kv_blocks_total=self.sessions.pool.usable_blocks,
            kv_preemptions=self.sessions.pool.preemptions,
            kv_prefix_blocks=self.sessions.pool.cached_blocks,
            kv_prefix_hit_positions=self.sessions.pool.prefix_hit_positions,
            attention_kernel=("triton" if model.ragged_attention is not None
                              else "cpu" if model.decode_attention is not None else ""),
            packed_weights=any(isinstance(m, packed_weights.PackedLinear) for m in model.modules()),
            cuda_graphs=model.pass_graphs.captures.graphs if model.pass_graphs is not None else 0,
            queued_steps=self.batcher.queued,
            step_ms=self.batcher.step_ms,
            pass_ms=self.batcher.pass_ms,
            load_s=model.load_s,
            max_batch_tokens=self.batcher.max_tokens,
            fingerprint=self.fingerprint,
            decode_phase_seconds=self.batcher.timing.decode_seconds,
            decode_steps=self.batcher.timing.decode_steps,
            tp_size=model.tp_group.size if model.tp_group else 1,
            output_log_bytes=self.sessions.log_budget.used_bytes,
            output_logs_dropped=self.sessions.log_budget.dropped,
            link_sessions=self.links.sessions,
            relay_queued_bytes=self.links.queued_bytes,
            streams_waiting=sum(b.waiting > 0 for b in self.budgets),
        )
