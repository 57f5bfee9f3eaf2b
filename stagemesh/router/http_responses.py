"""The OpenAI API's answers at the router's HTTP front (router/http_api.py): a whole completion, the chunks of a
streamed one, usage and log-probabilities, in OpenAI's shapes (`text_completion`, `chat.completion`,
`chat.completion.chunk`), built from the GenerateResponses RouterService streams."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stagemesh.router.generation import GenerationRequest
from stagemesh.router.http_requests import ChatBody, CompletionBody
from stagemesh.v1 import router_pb2

FINISH_REASONS = {
    router_pb2.FINISH_REASON_LENGTH: "length",
    router_pb2.FINISH_REASON_STOP: "stop",
    router_pb2.FINISH_REASON_EOS: "stop",  # OpenAI's "stop": a stop sequence or the model's own end
}


def finite(x: float) -> float:
    """JSON has no -inf: a log-probability below float32's range reads as -9999 (as vLLM writes it)."""
    return x if math.isfinite(x) and x > -9999.0 else -9999.0


@dataclass
class Choice:
    """What one choice has streamed so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[router_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: router_pb2.Usage | None = None
    cached_tokens: int = 0
    chars: int = 0
    started: bool = False

    def add(self, r: router_pb2.GenerateResponse) -> None:
        self.text.append(r.text)
        self.chars += len(r.text)
        self.token_ids.extend(r.token_ids)
        self.logprobs.extend(r.logprobs)
        if r.finish_reason:
            self.finish_reason = FINISH_REASONS.get(r.finish_reason, "stop")
            self.cached_tokens = r.cached_tokens
        if r.HasField("usage"):
            self.usage = r.usage


@dataclass
class Call:
    """One HTTP request to a generation endpoint, from its parsed body to its choices' streams."""

    kind: Literal["completion", "chat"]
    body: CompletionBody | ChatBody
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    reqs: list[GenerationRequest] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def usage(self) -> dict:
        """Usage of the whole request: the prompt once, the tokens of every choice (the stages' counts when they
        reported them, else what streamed)."""
        first = self.choices[0]
        prompt = first.usage.prompt_tokens if first.usage else len(self.reqs[0].prompt_ids)
        cached = first.usage.cached_tokens if first.usage else first.cached_tokens
        completion = sum(c.usage.completion_tokens if c.usage else len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


TokenText = Callable[[int], str]
"""A token id's text (the tokenizer's decode of it alone), for log-probabilities."""


def compact(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def whole(call: Call, token_text: TokenText) -> dict:
    """The answer of a call that was not streamed, once every choice has finished."""
    entries = []
    for i, c in enumerate(call.choices):
        text = "".join(c.text)
        entry: dict[str, Any] = {"index": i}
        if call.kind == "chat":
            entry["message"] = {"role": "assistant", "content": text}
            entry["logprobs"] = chat_logprobs(c.logprobs, token_text) if call.body.logprobs else None
        else:
            entry["text"] = text
            entry["logprobs"] = (completion_logprobs(c.logprobs, 0, token_text)
                                 if call.body.logprobs is not None else None)
        entry["finish_reason"] = c.finish_reason
        if call.body.return_token_ids:
            entry["token_ids"] = c.token_ids
            if call.kind == "completion":
                entry["prompt_token_ids"] = call.reqs[i].prompt_ids
        entries.append(entry)
    out = {"id": call.id, "object": "chat.completion" if call.kind == "chat" else "text_completion",
           "created": call.created, "model": call.model, "choices": entries, "usage": call.usage()}
    if call.body.return_token_ids and call.kind == "chat":
        out["prompt_token_ids"] = call.reqs[0].prompt_ids
    return out


def chunk(call: Call, index: int, response: router_pb2.GenerateResponse, token_text: TokenText) -> str:
    """The event of one response of choice `index` (its first says the chat role)."""
    choice = call.choices[index]
    offset = choice.chars  # where this text starts in the choice's
    choice.add(response)
    entry: dict[str, Any] = {"index": index}
    if call.kind == "chat":
        delta: dict[str, Any] = {"content": response.text}
        if not choice.started:
            delta = {"role": "assistant", **delta}
        entry["delta"] = delta
        entry["logprobs"] = chat_logprobs(response.logprobs, token_text) if call.body.logprobs else None
    else:
        entry["text"] = response.text
        entry["logprobs"] = (completion_logprobs(response.logprobs, offset, token_text)
                             if call.body.logprobs is not None else None)
    entry["finish_reason"] = FINISH_REASONS.get(response.finish_reason) if response.finish_reason else None
    if call.body.return_token_ids:
        entry["token_ids"] = list(response.token_ids)
        if not choice.started and call.kind == "completion":
            entry["prompt_token_ids"] = call.reqs[index].prompt_ids
    out: dict[str, Any] = {"id": call.id, "object": call.chunk_object, "created": call.created, "model": call.model,
                           "choices": [entry]}
    if call.body.return_token_ids and call.kind == "chat" and not choice.started and index == 0:
        out["prompt_token_ids"] = call.reqs[0].prompt_ids
    if call.include_usage:
        out["usage"] = None
    choice.started = True
    return compact(out)


def usage_chunk(call: Call) -> str:
    """stream_options.include_usage: the last event, usage and no choices."""
    return compact({"id": call.id, "object": call.chunk_object, "created": call.created, "model": call.model,
                    "choices": [], "usage": call.usage()})


def chat_logprobs(logprobs: Sequence[router_pb2.TokenLogprob], token_text: TokenText) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t.token_id, t.logprob)
                                                                             for t in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion_logprobs(logprobs: Sequence[router_pb2.TokenLogprob], offset: int, token_text: TokenText) -> dict:
    """The legacy completions shape; text_offset counts from the start of the choice's text."""
    tokens, offsets = [], []
    for lp in logprobs:
        tokens.append(token_text(lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [{token_text(t.token_id): finite(t.logprob) for t in lp.top} for lp in logprobs],
            "text_offset": offsets}
