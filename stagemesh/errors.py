"""One error shape for every stagemesh server: handlers raise, one interceptor per server answers.

A handler that refuses a call raises StatusError(code, message) (or a domain exception its server
maps to a code); the interceptor turns it into the call's status. Anything else is a bug: it is
logged once, with the request id, and the caller gets INTERNAL with a fixed message that points to
that log line, never the exception's text (which may hold paths, tensors or other callers' data).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

REQUEST_ID_KEY = "x-request-id"
"""Call metadata that carries the request id across hops (the router sets it on every stage call)."""


def request_id_in(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The request id a caller (the router, for a stage) sent in the call's metadata, or ""."""
    return next((str(v) for k, v in metadata or () if k == REQUEST_ID_KEY), "")


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    return request_id_in(context.invocation_metadata())


class StatusError(Exception):
    """A refusal the caller can act on: it reaches the caller as `code` with `message`, as is."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
"""What a server interceptor calls for the handler of the interceptors inside it."""
ErrorCodes = Mapping[type[BaseException], grpc.StatusCode]
"""Domain exceptions a server maps to codes (their text is the caller's message); the most
specific class in an exception's MRO wins."""


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps what a handler raises to the call's status, for unary and streaming handlers alike.

    Installed once per server (grpc_server.new_server(interceptors=...)), so handlers need no
    try/except around their work. context.abort()'s own exception and cancellation pass through.
    Handlers must be async (coroutines or async generators), as all of stagemesh's are."""

    def __init__(self, log: logging.Logger, codes: ErrorCodes | None = None):
        self.log = log
        self.codes = dict(codes or {})

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        return _wrap(handler, _Call(self, details))

    def code_of(self, exc: BaseException) -> grpc.StatusCode | None:
        """The code of the most specific mapped class exc is an instance of; None: not mapped."""
        for cls in type(exc).__mro__:
            if cls in self.codes:
                return self.codes[cls]
        return None


class _Call:
    """One call's view for the wrapper: its method and request id, and how to answer a failure."""

    def __init__(self, interceptor: StatusInterceptor, details: grpc.HandlerCallDetails):
        self.interceptor = interceptor
        self.method = details.method.lstrip("/")
        self.request_id = request_id_in(details.invocation_metadata)

    async def fail(self, exc: Exception, context: grpc.aio.ServicerContext, request: Any = None) -> None:
        """Aborts the call for exc: always raises (grpc's AbortError)."""
        if isinstance(exc, StatusError):
            await context.abort(exc.code, exc.message)
        code = self.interceptor.code_of(exc)
        if code is not None:
            await context.abort(code, str(exc))
        # A unary request may name its request id in the message when the caller set no metadata;
        # failing both, a fresh id still ties the caller's message to the log line.
        named = getattr(request, "request_id", "") if isinstance(request, Message) else ""
        request_id = self.request_id or str(named) or uuid.uuid4().hex[:16]
        self.interceptor.log.exception(f"unexpected error in {self.method}", exc_info=exc,
                                       extra={"request_id": request_id})
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"internal error in {self.method}; the server logged it with request id {request_id}")


def _wrap(handler: grpc.RpcMethodHandler, call: _Call) -> grpc.RpcMethodHandler:
    """The same handler with its behavior wrapped; serializers and streaming kinds unchanged."""
    serdes = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_unary_response(handler.unary_unary, call), **serdes)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_unary_response(handler.stream_unary, call), **serdes)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_stream_response(handler.unary_stream, call), **serdes)
    return grpc.stream_stream_rpc_method_handler(_stream_response(handler.stream_stream, call), **serdes)


def _unary_response(behavior: Callable, call: _Call) -> Callable:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await call.fail(exc, context, request)

    return wrapped


def _stream_response(behavior: Callable, call: _Call) -> Callable:
    """Response streams come as async generators, or as coroutines that call context.write()
    (grpc's health Watch): the wrapper keeps the kind, which grpc tells apart by inspection."""
    if not inspect.isasyncgenfunction(behavior):
        return _unary_response(behavior, call)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        responses = behavior(request, context)
        context.add_done_callback(lambda _: _close_soon(responses))
        try:
            async for response in responses:
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await call.fail(exc, context, request)
        finally:
            # Closed now, not whenever it is collected: the handler's own cleanup (a stage closes
            # the stream's sessions) must run when the call ends.
            await responses.aclose()

    return wrapped


_closing: set[asyncio.Task] = set()


def _close_soon(responses: AsyncGenerator) -> None:
    """Closes a handler's generator once its call has ended. grpc.aio iterates the outermost wrapper and
    never closes it: a call cancelled while the server waits in a write leaves the wrappers suspended, and
    the handler's cleanup (the router's admission slot, a stage's stream sessions) waits for whatever frees
    them, the garbage collector when they sit in a reference cycle (seen: a router slot held > 10 s)."""
    with contextlib.suppress(RuntimeError):  # no running loop: the server is gone with it
        task = asyncio.get_running_loop().create_task(_aclose(responses))
        _closing.add(task)
        task.add_done_callback(_closing.discard)


async def _aclose(responses: AsyncGenerator) -> None:
    # RuntimeError: it is running (a cancelled call unwinding through it closes it itself).
    with contextlib.suppress(Exception):
        await responses.aclose()
