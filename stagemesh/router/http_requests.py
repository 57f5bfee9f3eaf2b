"""The OpenAI API's requests at the router's HTTP front (router/http_api.py): the bodies as pydantic models, their
conversion into the public stagemesh.v1.GenerateRequest, and OpenAI's error object with the HTTP status of each gRPC
status.

Bodies are strict ("5" is not a number, 1.5 not an integer, as OpenAI's API has it). Unknown fields are kept and
ignored, as OpenAI and vLLM do (the router logs their names); known OpenAI fields whose meaning this front does not
implement (echo, suffix, best_of other than n, tools, functions, a response_format other than text) are refused
with 400 rather than ignored, since ignoring them would silently change the answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Literal, TypeVar

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stagemesh.errors import StatusError
from stagemesh.grpc_server import PUBLIC_MAX_MESSAGE_BYTES
from stagemesh.v1 import router_pb2

log = logging.getLogger("stagemesh.router")

MAX_CHOICES = 8
"""`n`: choices of one request, each a stream of its own."""
MAX_BODY_BYTES = PUBLIC_MAX_MESSAGE_BYTES
"""The most a request body may hold, as the gRPC port's message limit."""
MAX_TOP_LOGPROBS = 20
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""gRPC status -> HTTP status; any other code is 500."""
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
"""OpenAI's error `type` by HTTP status: these, else invalid_request_error (4xx) or server_error (5xx)."""
ERROR_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    grpc.StatusCode.OUT_OF_RANGE: "context_length_exceeded",
}
"""OpenAI's error `code` where it has one; else the gRPC status's name in lower case."""


class ApiError(Exception):
    """A refusal in OpenAI's error object: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def of(cls, exc: StatusError) -> ApiError:
        # The gRPC messages name the proto's field; an HTTP caller sent max_tokens.
        message = exc.message.replace("max_new_tokens", "max_tokens")
        return cls(HTTP_STATUS.get(exc.code, 500), message, code=ERROR_CODES.get(exc.code, exc.code.name.lower()))

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str = "invalid_argument") -> ApiError:
    return ApiError(400, message, param, code)


# The request bodies. Strict: "5" is not a number and 1.5 not an int, as OpenAI's API has it; extra fields are
# kept (and ignored), as OpenAI and vLLM do.
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice's token_ids, and the prompt's (prompt_token_ids)."""
    cache_salt: str | None = None
    """vLLM's extension: prefix-cache blocks are shared only between this caller's requests with the same salt."""


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


B = TypeVar("B", bound=Sampling)


def parse_body(raw: bytes, model: type[B]) -> B:
    """The body as `model`, or ApiError(400) naming the first field that is wrong."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise bad("the body must be a JSON object")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise bad(f"{where or 'body'}: {first['msg']}", param) from None


def derived_seed(seed: int, choice: int) -> int:
    """Choice 0 draws with the seed itself; choice i with a seed made from (seed, i): n choices differ, and the same
    request gives the same n again."""
    if choice == 0:
        return seed
    digest = hashlib.sha256(f"stagemesh-choice:{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def refuse_unsupported(kind: str, body: CompletionBody | ChatBody, request_id: str) -> None:
    """Known OpenAI fields this front does not implement, where ignoring them would change the answer: 400."""
    extra = body.model_extra or {}
    if kind == "completion":
        if body.echo:
            raise bad("echo is not supported: the prompt is not returned with the completion", "echo",
                      "unsupported")
        if body.suffix:
            raise bad("suffix is not supported (no insertion)", "suffix", "unsupported")
        if body.best_of is not None and body.best_of != body.n:
            raise bad("best_of is not supported: ask for n choices instead", "best_of", "unsupported")
    else:
        for name in ("tools", "functions"):
            if extra.get(name):
                raise bad(f"{name} are not supported: this router serves plain chat completions", name,
                          "unsupported")
        response_format = extra.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format", "unsupported")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    ignored = sorted(set(extra) - {"tools", "functions", "response_format"})
    if ignored:
        log.info(f"ignored fields this front does not know: {', '.join(ignored)}",
                 extra={"request_id": request_id})


def generate_request(body: CompletionBody | ChatBody, request_id: str, priority: int) -> router_pb2.GenerateRequest:
    """The body's sampling fields as the public proto's (the prompt is set apart). Left out, temperature and top_p
    are OpenAI's defaults (1: sampling), not the proto's (0: greedy)."""
    proto = router_pb2.GenerateRequest(
        request_id=request_id,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),  # vLLM's -1: no limit, as 0
        min_p=body.min_p or 0.0,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or ()),
        priority=priority,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 0.0,
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        cache_salt=body.cache_salt or "",
    )
    max_tokens = body.max_completion_tokens or body.max_tokens if isinstance(body, ChatBody) else body.max_tokens
    proto.max_new_tokens = max_tokens or 0  # 0: the context left after the prompt (fill_context)
    if body.seed is not None:
        proto.seed = body.seed % 2**64  # OpenAI takes any integer; the proto an unsigned 64-bit one
    for key, bias in (body.logit_bias or {}).items():
        try:
            proto.logit_bias[int(key)] = bias
        except (ValueError, OverflowError):
            raise bad(f"logit_bias: the keys are token ids, got {key!r}", "logit_bias") from None
    if isinstance(body, ChatBody):
        proto.logprobs = body.logprobs
        proto.top_logprobs = body.top_logprobs or 0
    elif body.logprobs is not None:
        proto.logprobs = True
        proto.top_logprobs = body.logprobs
    return proto


def set_prompt(proto: router_pb2.GenerateRequest, prompt: str | list) -> None:
    """A completion's prompt: text, or token ids; one of either (a list of one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad(f"prompt: {len(prompt)} prompts in one request; send one per request (or use n for several "
                      "choices of one)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        proto.prompt = prompt
    else:
        try:
            proto.token_ids.extend(prompt)
        except ValueError:  # beyond int32: outside any vocabulary
            raise bad("prompt: token ids must be 32-bit integers in the model's vocabulary", "prompt") from None
