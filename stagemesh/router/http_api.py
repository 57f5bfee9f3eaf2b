"""The router's OpenAI-compatible HTTP front (`--http-port`): /v1/completions, /v1/chat/completions, /v1/models and
/health, a FastAPI app served by uvicorn in the router's own event loop (router/http_server.py).

One code path behind both front doors: a JSON body (router/http_requests.py) becomes a stagemesh.v1.GenerateRequest,
which goes through RouterService's validation (to_generation_request) and streaming (_stream) exactly as a gRPC
call's does; only the shapes at the edge differ (router/http_responses.py). Tokens, priorities and rates are
router.auth's (admit_call, as the gRPC interceptor's); the metrics are _stream's; a request is one span when tracing is
on. Tokenizing and chat templates run off the event loop.

Choices (`n`) are streams of their own that share the prompt: the first starts alone and the others once it has
its first token, when its prompt's blocks are in every stage's prefix cache. With a seed, choice i draws with a seed
derived from (seed, i) (choice 0 with the seed itself, as a gRPC call with that seed); without one each choice's
seed is the router's own fresh draw. A caller that hangs up cancels its request: every stage closes its sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stagemesh import tracing
from stagemesh.errors import REQUEST_ID_KEY, StatusError
from stagemesh.request_limits import MAX_PROMPT_CHARS_PER_TOKEN, request_id_problem
from stagemesh.router.auth import CALLER, GRANT, Grant, TokenAuth, check_call
from stagemesh.router.cache_scope import caller_identity, peer_identity
from stagemesh.router.http_requests import (
    MAX_BODY_BYTES,
    ApiError,
    ChatBody,
    CompletionBody,
    bad,
    derived_seed,
    generate_request,
    parse_body,
    refuse_unsupported,
    set_prompt,
)
from stagemesh.router.http_responses import Call, Choice, chunk, usage_chunk, whole
from stagemesh.router.http_server import ClientGone, until_disconnected
from stagemesh.router.router_service import RouterService
from stagemesh.v1 import router_pb2

log = logging.getLogger("stagemesh.router")

PARSE_IN_THREAD_BYTES = 64 * 1024
"""Bodies larger than this are parsed and validated off the event loop."""
PRIORITY_HEADER = "x-priority"


class HttpFront:
    """The FastAPI app over a RouterService: `app`."""

    def __init__(self, service: RouterService, model_name: str, auth: TokenAuth | None,
                 stopping: Callable[[], bool] = lambda: False):
        self.service = service
        self.model_name = model_name
        self.auth = auth
        self.stopping = stopping
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self.app = self._build()

    def _build(self) -> FastAPI:
        # No /docs, /redoc or /openapi.json: nothing but the API answers on this port.
        app = FastAPI(title="stagemesh", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            # Unknown paths and methods: OpenAI's error object too.
            return ApiError(exc.status_code, str(exc.detail), code=None).response(exc.headers)

        @app.exception_handler(Exception)
        async def unexpected(request: Request, exc: Exception) -> JSONResponse:
            return self._internal(request.headers.get(REQUEST_ID_KEY, ""), exc)

        return app

    # Endpoints
    async def health(self) -> JSONResponse:
        """200 while a whole chain can serve and the router is not stopping, else 503; open to any caller."""
        usable = len(self.service.chains.usable())
        ok = usable > 0 and not self.stopping()
        return JSONResponse({"status": "ok" if ok else "unavailable", "usable_chains": usable},
                            status_code=200 if ok else 503)

    def _model_entry(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "stagemesh",
                "max_model_len": self.service.max_position}

    async def models(self, request: Request) -> Response:
        return await self._simple(request, lambda: {"object": "list", "data": [self._model_entry()]})

    async def model(self, request: Request, model: str) -> Response:
        def entry() -> dict:
            self._check_model(model)
            return self._model_entry()

        return await self._simple(request, entry)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    # What every call goes through
    async def _simple(self, request: Request, answer: Callable[[], dict]) -> Response:
        rid, headers = self._request_id(request)
        try:
            if rid is None:
                raise bad(f"the {REQUEST_ID_KEY} header: {request_id_problem(request.headers[REQUEST_ID_KEY])}",
                          REQUEST_ID_KEY)
            if self.auth is not None:
                self._admit(request, self._authenticate(request), router_pb2.GetModelInfoRequest())
            return JSONResponse(answer(), headers=headers)
        except StatusError as exc:
            return ApiError.of(exc).response(headers)
        except ApiError as exc:
            return exc.response(headers)

    def _request_id(self, request: Request) -> tuple[str | None, dict[str, str]]:
        """The caller's x-request-id (None when it is not one we can use) or a fresh one, and the response headers
        that echo it."""
        given = request.headers.get(REQUEST_ID_KEY)
        if given is None:
            rid = uuid.uuid4().hex[:16]
        elif request_id_problem(given):
            return None, {}
        else:
            rid = given
        return rid, {REQUEST_ID_KEY: rid}

    def _metadata(self, request: Request) -> list[tuple[str, str]]:
        value = request.headers.get("authorization")
        return [("authorization", value)] if value is not None else []

    def _peer(self, request: Request) -> str:
        client = request.client
        return f"{client.host}:{client.port}" if client else ""

    def _authenticate(self, request: Request) -> Grant:
        """The caller's grant, from its token alone (before its body is read); refused as check_call refuses."""
        try:
            return self.auth.authenticate(self._metadata(request))
        except StatusError as exc:
            return self._admit(request, exc, None)

    def _admit(self, request: Request, grant: Grant | StatusError, call: Any) -> Grant:
        """The call held to the caller's grant (priority, rate), as the gRPC interceptor holds it; CALLER and GRANT
        set for its log lines and its admission."""
        grant = check_call(self.auth, f"{request.method} {request.url.path}", grant, call, self._peer(request))
        CALLER.set(grant.name)
        GRANT.set(grant)
        return grant

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model `{model}` does not exist here: this router serves `{self.model_name}` "
                                "(GET /v1/models)", "model", "model_not_found")

    def _internal(self, request_id: str, exc: BaseException) -> JSONResponse:
        """A bug: logged once with the request id; the caller gets a fixed message that points to that line."""
        request_id = request_id if request_id and not request_id_problem(request_id) else uuid.uuid4().hex[:16]
        log.error("unexpected error in the HTTP front", exc_info=exc, extra={"request_id": request_id})
        return ApiError(500, f"internal error in the router; it logged it with request id {request_id}",
                        code="internal").response({REQUEST_ID_KEY: request_id})

    async def _read_body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body has {length} bytes; at most {MAX_BODY_BYTES} are accepted",
                           code="body_too_large")
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
            chunks.append(piece)
        return b"".join(chunks)

    async def _generate(self, request: Request, kind: Literal["completion", "chat"]) -> Response:
        rid, headers = self._request_id(request)
        span = tracing.http_server_span(f"{request.method} {request.url.path}", request.headers)
        handed_off = False  # the event stream ends the span when it ends
        try:
            with tracing.current(span):
                if rid is None:
                    raise bad(f"the {REQUEST_ID_KEY} header: {request_id_problem(request.headers[REQUEST_ID_KEY])}",
                              REQUEST_ID_KEY)
                grant = None
                if self.auth is not None:  # a caller without a token is refused before its body is read
                    grant = self._authenticate(request)
                raw = await self._read_body(request)
                model = ChatBody if kind == "chat" else CompletionBody
                body = (await asyncio.to_thread(parse_body, raw, model) if len(raw) > PARSE_IN_THREAD_BYTES
                        else parse_body(raw, model))
                call = Call(kind, body, rid, self.model_name)
                await self._prepare(request, call, grant)
                choices = self._choices(call)
                try:
                    first = await until_disconnected(request, anext(choices))
                except BaseException:
                    await choices.aclose()
                    raise
                if body.stream:
                    handed_off = True
                    return EventSourceResponse(self._events(call, choices, first, span), headers=headers, sep="\n")
                async with contextlib.aclosing(choices):
                    return JSONResponse(await until_disconnected(request, self._whole(call, choices, first)),
                                        headers=headers)
        except ClientGone:
            log.info("the caller left before its answer was ready: generation cancelled", extra={"request_id": rid})
            return Response(status_code=499)
        except StatusError as exc:
            return ApiError.of(exc).response(headers)
        except ApiError as exc:
            return exc.response(headers)
        except Exception as exc:  # a bug: logged, never shown
            return self._internal(rid or "", exc)
        finally:
            if span is not None and not handed_off:
                span.end()

    async def _prepare(self, request: Request, call: Call, grant: Grant | None) -> None:
        """Checks the call, admits its caller (token, priority, rate: each choice costs one request, as a prompt
        of GenerateBatch does) and makes a GenerationRequest per choice through to_generation_request."""
        body = call.body
        self._check_model(body.model)
        refuse_unsupported(call.kind, body, call.request_id)
        if not body.stream and body.stream_options is not None:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        if self.stopping():  # as the gRPC port, which takes no new calls then (no chain: _stream says so)
            raise ApiError(503, "the router is stopping: retry elsewhere or later", code="unavailable")
        priority = body.priority
        if priority is None and (header := request.headers.get(PRIORITY_HEADER)) is not None:
            try:
                priority = int(header)
            except ValueError:
                raise bad(f"the {PRIORITY_HEADER} header must be an integer, got {header!r}",
                          PRIORITY_HEADER) from None
        proto = generate_request(body, call.request_id, priority or 0)
        caller = ""
        if grant is not None:
            asked = proto if body.n == 1 else router_pb2.GenerateBatchRequest(requests=[proto] * body.n)
            caller = self._admit(request, grant, asked).name
        if call.kind == "chat":
            proto.token_ids.extend(await self._chat_prompt(call.body))
        else:
            set_prompt(proto, body.prompt)
        fill = proto.max_new_tokens == 0
        identity = caller_identity(grant, peer_identity(request.client.host if request.client else ""))
        first = await self.service.to_generation_request(proto, None, caller, identity=identity, fill_context=fill)
        call.reqs = [first]
        for i in range(1, body.n):  # the same prompt's ids (tokenized once), each choice its own seed
            other = router_pb2.GenerateRequest()
            other.CopyFrom(proto)
            other.ClearField("prompt")
            del other.token_ids[:]
            other.token_ids.extend(first.prompt_ids)
            if body.seed is not None:
                other.seed = derived_seed(proto.seed, i)
            call.reqs.append(await self.service.to_generation_request(other, None, caller, identity=identity,
                                                                      fill_context=fill))
        call.choices = [Choice() for _ in call.reqs]

    async def _chat_prompt(self, body: ChatBody) -> list[int]:
        """The messages through the checkpoint's chat template (add_generation_prompt), tokenized as transformers'
        apply_chat_template(tokenize=True) does (the template writes the special tokens), off the event loop."""
        tokenizer = self.service.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad(f"the model `{self.model_name}` has no chat template (its tokenizer sets none): send the "
                      "prompt to /v1/completions instead", "messages", "no_chat_template")
        messages = []
        chars = 0
        for m in body.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(
                part.text for part in m.content)
            chars += len(content or "")
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content,
                             **({"name": m.name} if m.name is not None else {})})
        limit = self.service.max_position * MAX_PROMPT_CHARS_PER_TOKEN
        if chars > limit:
            raise ApiError(400, f"the messages have {chars} characters, more than the model's context of "
                                f"{self.service.max_position} tokens can hold: shorten them", "messages",
                           "context_length_exceeded")

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        try:
            return await asyncio.to_thread(render)
        except jinja2.TemplateError as exc:  # the template refused these messages, saying why
            raise bad(f"the chat template refused the messages: {exc}", "messages") from None

    async def _choices(self, call: Call) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
        """Each choice's responses, tagged with its index, as they come. Choice 0 starts alone; the others once it
        has its first token (its prompt then sits in every stage's prefix cache). A failure of any ends them all.
        Closing this closes every choice's stream (their stages close the sessions)."""
        first = self.service._stream(call.reqs[0])
        async with contextlib.aclosing(first):
            yield 0, await anext(first)
            if len(call.reqs) == 1:
                async for response in first:
                    yield 0, response
                return
            queue: asyncio.Queue[tuple[int, router_pb2.GenerateResponse | BaseException | None]] = asyncio.Queue(64)

            async def pump(index: int, stream: AsyncIterator[router_pb2.GenerateResponse]) -> None:
                try:
                    async with contextlib.aclosing(stream):
                        async for r in stream:
                            await queue.put((index, r))
                except Exception as exc:
                    await queue.put((index, exc))
                else:
                    await queue.put((index, None))

            tasks = [asyncio.ensure_future(pump(0, first)),
                     *(asyncio.ensure_future(pump(i, self.service._stream(r))) for i, r in enumerate(call.reqs)
                       if i > 0)]
            try:
                running = len(tasks)
                while running:
                    index, item = await queue.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield index, item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _whole(self, call: Call, choices: AsyncIterator, first: tuple[int, router_pb2.GenerateResponse]) -> dict:
        index, response = first
        call.choices[index].add(response)
        async for index, response in choices:
            call.choices[index].add(response)
        return whole(call, self.token_text)

    async def _events(self, call: Call, choices: AsyncIterator, first: tuple[int, router_pb2.GenerateResponse],
                      span) -> AsyncIterator[str]:
        """The server-sent events of a streamed call, in OpenAI's chunk shapes, ending with `data: [DONE]`. A
        failure after the first event is an event with OpenAI's error object. Cancelled (the caller left) or
        closed, it closes every choice's stream."""
        try:
            async with contextlib.aclosing(choices):
                yield chunk(call, *first, self.token_text)
                try:
                    async for index, response in choices:
                        yield chunk(call, index, response, self.token_text)
                except StatusError as exc:
                    yield json.dumps(ApiError.of(exc).body())
                    yield "[DONE]"
                    return
                except Exception as exc:
                    log.error("unexpected error in an HTTP stream", exc_info=exc,
                              extra={"request_id": call.request_id})
                    yield json.dumps(ApiError(500, "internal error in the router; it logged it with request id "
                                                   f"{call.request_id}", code="internal").body())
                    yield "[DONE]"
                    return
            if call.include_usage:
                yield usage_chunk(call)
            yield "[DONE]"
        finally:
            if span is not None:
                span.end()

    def _token_text(self, token_id: int) -> str:
        return self.service.tokenizer.decode([token_id])
