"""The routers `stagemesh bench` calls, and what one request looked like from the caller's side: gRPC through
stagemesh.client (its blocking stream, one thread per request in flight), HTTP through the OpenAI-compatible
`POST /v1/completions` with `stream: true` (server-sent events, one completion chunk per message, then
`data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx

from stagemesh.bench_workload import BenchRequest
from stagemesh.client import Client, ModelInfo

log = logging.getLogger("stagemesh.bench")
UNUSABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.DEADLINE_EXCEEDED)
"""GetModelInfo's answers that say no request would get through either."""


@dataclass
class Outcome:
    """One request as its caller saw it; times in seconds from the moment it was sent."""

    input_len: int | None
    max_tokens: int
    error: str = ""
    """Why it failed, by status: a gRPC status name, `HTTP 429`, `timeout`, a transport error's name; "" if not."""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    """The gaps between consecutive streamed messages after the first (a message carrying several tokens is
    one gap)."""
    sent_s: float = 0.0
    """When it was sent, from the start of the measured run."""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.error or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class StreamTimer:
    """Clocks one stream: started when made, a time for each message that carries tokens."""

    def __init__(self, request: BenchRequest):
        self.request = request
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens = 0

    def arrived(self, tokens: int) -> None:
        self.times.append(time.perf_counter())
        self.tokens += tokens

    def outcome(self, error: str = "", *, tokens: int | None = None, input_len: int | None = None) -> Outcome:
        """tokens / input_len: the server's own counts (its usage), where it gave them."""
        t = self.times
        return Outcome(input_len if input_len is not None else self.request.input_len, self.request.max_tokens,
                       error, t[0] - self.start if t else None, time.perf_counter() - self.start,
                       tokens if tokens is not None else self.tokens, [b - a for a, b in zip(t, t[1:], strict=False)])


@dataclass(frozen=True)
class Sampling:
    """What every request asks for besides its prompt and length."""

    temperature: float
    ignore_eos: bool
    """Ask for exactly max_tokens: ignore_eos, and min_tokens = max_tokens (a server that knows neither still
    stops at its end-of-sequence token)."""


class GrpcTarget:
    """A router's gRPC port, through stagemesh.client: each request's blocking stream runs on a thread of its own,
    which clocks its messages as they arrive."""

    def __init__(self, address: str, sampling: Sampling, *, threads: int, token: str | None, ca: str | None,
                 cert: str | None, key: str | None, timeout_s: float):
        self.sampling = sampling
        self.client = Client(address, token=token, ca=ca, cert=cert, key=key, timeout_s=timeout_s)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench")

    async def describe(self) -> ModelInfo | None:
        """The router's GetModelInfo; None from a router that cannot answer it (an older one). ConnectionError
        where the router cannot be called at all: unreachable, or the token refused."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self.client.model_info)
        except grpc.RpcError as exc:
            if exc.code() in UNUSABLE:
                raise ConnectionError(f"{exc.code().name}: {exc.details()}") from None
            log.warning(f"GetModelInfo: {exc.code().name}: {exc.details()}")
            return None

    async def send(self, request: BenchRequest) -> Outcome:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._call, request)

    def _call(self, request: BenchRequest) -> Outcome:
        timer = StreamTimer(request)
        force = self.sampling.ignore_eos
        try:
            for piece in self.client.generate(request.prompt, max_new_tokens=request.max_tokens,
                                              temperature=self.sampling.temperature, ignore_eos=force,
                                              min_tokens=request.max_tokens if force else 0):
                if piece.token_ids:
                    timer.arrived(len(piece.token_ids))
        except grpc.RpcError as exc:
            return timer.outcome(exc.code().name)
        return timer.outcome()

    async def close(self) -> None:
        self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class HttpTarget:
    """A router's OpenAI-compatible HTTP port: `POST /v1/completions` streamed, with usage on its last chunk
    (stream_options.include_usage) counting the tokens where the server gives it."""

    def __init__(self, base_url: str, sampling: Sampling, *, model: str, token: str | None, ca: str | None,
                 cert: str | None, key: str | None, timeout_s: float):
        self.sampling, self.model = sampling, model
        token = token if token is not None else os.environ.get("STAGEMESH_TOKEN")  # as stagemesh.client reads it
        context = ssl.create_default_context(cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
        self.http = httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {token}"} if token else {}, verify=context,
            timeout=timeout_s, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def describe(self) -> ModelInfo:
        """The model's name only (the OpenAI API tells no vocabulary size: vocab_size 0), once GET /v1/models shows
        the server reachable and the token accepted; the name is the first listed there where no --model was
        given."""
        try:
            response = await self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ConnectionError(f"GET /v1/models: {exc!r}") from None
        if response.status_code in (401, 403):
            raise ConnectionError(f"GET /v1/models: HTTP {response.status_code}: {response.text[:300]}")
        if not self.model:
            try:
                response.raise_for_status()
                self.model = response.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise ConnectionError(f"GET /v1/models gave no model ({exc!r}): give --model") from None
        return ModelInfo(self.model, 0, 0, "", False, ())

    async def send(self, request: BenchRequest) -> Outcome:
        body = {"model": self.model, "prompt": request.prompt if isinstance(request.prompt, str) else
                list(request.prompt), "max_tokens": request.max_tokens, "temperature": self.sampling.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.sampling.ignore_eos:  # vLLM's extra fields, which OpenAI's API lacks
            body |= {"ignore_eos": True, "min_tokens": request.max_tokens}
        timer, usage = StreamTimer(request), {}
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return timer.outcome(f"HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data) if data else {}
                    if error := chunk.get("error"):  # OpenAI's error object, mid-stream
                        return timer.outcome(f"HTTP {isinstance(error, dict) and error.get('code') or 'stream error'}")
                    usage = chunk.get("usage") or usage
                    choice = (chunk.get("choices") or [None])[0]
                    if choice and (choice.get("text") or choice.get("finish_reason") is None):
                        timer.arrived(1)  # one token a chunk; a last chunk of no text carries only its reason
        except httpx.TimeoutException:
            return timer.outcome("timeout")
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return timer.outcome(type(exc).__name__)
        return timer.outcome(tokens=usage.get("completion_tokens"), input_len=usage.get("prompt_tokens"))

    async def close(self) -> None:
        await self.http.aclose()
