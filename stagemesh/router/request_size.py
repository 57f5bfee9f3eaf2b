"""Sizes checked on the wire, before a request is parsed: parsing is the first thing that costs the router's event
loop per byte (16 MiB of token ids took ~0.7 s of it here, the list and scan after it ~2 s more), so a prompt
longer than the model's context is refused from the length prefixes of its fields, never materialized.

The peek reads a message's top-level fields (each a tag, and for the length-delimited ones a length it skips by)
until it has seen the prompt's fields; protobuf's serializers write fields in number order, so that is the first
one or two. A message whose field lengths prove it too long (token_ids: at least one byte per id; prompt: at most
four bytes per character) gets an Oversized in place of the request, and the handler is never called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from stagemesh.errors import Continuation, StatusError
from stagemesh.request_limits import MAX_PROMPT_CHARS_PER_TOKEN
from stagemesh.v1 import router_pb2

PROMPT, TOKEN_IDS = 1, 2
"""GenerateRequest's prompt (text) and token_ids (packed int32) field numbers."""
BATCH_REQUESTS = 1
"""GenerateBatchRequest's requests field number."""
PEEK_FIELDS = 64
"""Fields read at most per message; past them the message is parsed as it is (its other bounds apply)."""
UTF8_MAX_BYTES = 4
ID_MAX_BYTES = 5
"""A token id (an int32 >= 0) as a varint: at most 5 bytes."""
SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass(frozen=True)
class Oversized:
    """Stands for a request refused from its field lengths: the reason, for the caller."""

    reason: str


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and the offset after it; ValueError past the end or past 10 bytes."""
    value = shift = 0
    for i in range(at, min(at + 10, len(data))):
        value |= (data[i] & 0x7F) << shift
        if data[i] < 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("truncated varint")


def _fields(data: bytes, start: int = 0, end: int | None = None):
    """(field number, offset, length) of the length-delimited top-level fields in data[start:end], the others
    skipped, at most PEEK_FIELDS fields; stops at anything malformed (the parser will say so)."""
    end = len(data) if end is None else end
    at = start
    for _ in range(PEEK_FIELDS):
        if at >= end:
            return
        try:
            tag, at = _varint(data, at)
            kind = tag & 7
            if kind == 0:
                _, at = _varint(data, at)
            elif kind == 1:
                at += 8
            elif kind == 5:
                at += 4
            elif kind == 2:
                length, at = _varint(data, at)
                yield tag >> 3, at, length
                at += length
            else:
                return
        except ValueError:
            return


def prompt_problem(data: bytes, max_position: int, start: int = 0, end: int | None = None) -> str | None:
    """Why a GenerateRequest (data[start:end]) is surely longer than the model's context, from its fields'
    lengths; None when it may not be (the parsed request is checked as before)."""
    for number, _, length in _fields(data, start, end):
        if number == TOKEN_IDS and length > ID_MAX_BYTES * max_position:  # packed, at most 5 bytes a valid id
            return f"token_ids hold {length} bytes, more than {max_position} ids (the model's context) take: " \
                   "shorten the prompt"
        if number == PROMPT and length > UTF8_MAX_BYTES * MAX_PROMPT_CHARS_PER_TOKEN * max_position:
            return f"the prompt holds {length} bytes, more than the model's context of {max_position} tokens " \
                   "can hold: shorten it"
    return None


def _too_long_generate(max_position: int) -> Callable[[bytes], str | None]:
    return lambda data: prompt_problem(data, max_position)


def _too_long_batch(max_position: int) -> Callable[[bytes], str | None]:
    def problem(data: bytes) -> str | None:
        count = 0
        for number, at, length in _fields(data):
            if number != BATCH_REQUESTS:
                continue
            count += 1
            if (why := prompt_problem(data, max_position, at, at + length)) is not None:
                return f"request {count - 1}: {why}"
        return None
    return problem


class RequestSizeInterceptor(grpc.aio.ServerInterceptor):
    """Generate and GenerateBatch with a deserializer that refuses (Oversized) what is surely too long, before
    parsing, and a behavior that answers it OUT_OF_RANGE. Inside StatusInterceptor, which answers the error."""

    def __init__(self, max_position: int):
        self.checks = {f"/{SERVICE}/Generate": _too_long_generate(max_position),
                       f"/{SERVICE}/GenerateBatch": _too_long_batch(max_position)}

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        check = self.checks.get(details.method)
        if handler is None or check is None or not handler.unary_stream:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_stream

        def deserialize(data: bytes):
            why = check(data)
            return Oversized(why) if why is not None else parse(data)

        async def checked(request, context):  # the Router's streams are async generators
            if isinstance(request, Oversized):
                raise StatusError(grpc.StatusCode.OUT_OF_RANGE, request.reason)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(checked, request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)

