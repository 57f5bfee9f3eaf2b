"""Bounds on what a caller may ask for, checked at the router's front door and again at each stage
(so a stage reached directly, or through a router of another build, is held to the same)."""

from __future__ import annotations

import math
import re

MAX_TEMPERATURE = 100.0
"""Past this, softmax is flat to float32 precision: the draw is uniform, so larger values mean nothing."""
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = re.compile(rf"^[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}$")
"""Printable ASCII without spaces: it travels as gRPC metadata and in every log line."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_BATCH_REQUESTS = 256
"""Prompts in one GenerateBatch call; more wait for a later call (the caller splits)."""
MAX_PROMPT_CHARS_PER_TOKEN = 64
"""A text prompt longer than context x this cannot fit the context once tokenized: refused before
tokenizing, so that a huge text costs the router nothing."""


class InvalidSampling(ValueError):
    """Sampling parameters no draw can honour; the message says which and what to send."""


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raises InvalidSampling unless the values are finite and in range."""
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise InvalidSampling(f"temperature {temperature!r}: use 0 (greedy) or a finite value in (0, "
                              f"{MAX_TEMPERATURE:g}]")
    if top_k < 0:
        raise InvalidSampling(f"top_k {top_k}: use 0 (no limit) or a positive count")
    if not (math.isfinite(top_p) and 0.0 <= top_p <= 1.0):
        raise InvalidSampling(f"top_p {top_p!r}: use a value in [0, 1] (0 or 1: no limit)")


def request_id_problem(request_id: str) -> str | None:
    """Why a caller's request id cannot be used, or None when it can."""
    if REQUEST_ID.match(request_id):
        return None
    n = len(request_id)
    got = f"{n} characters" if not 1 <= n <= MAX_REQUEST_ID_CHARS else "a space, a control or a non-ASCII character"
    return f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces (got {got})"


MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's bounds)."""
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0
"""A logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's bounds)."""
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64


def check_processing(*, vocab_size: int | None, min_p: float = 0.0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, repetition_penalty: float = 0.0,
                     logit_bias: dict[int, float] | None = None, logprobs: bool = False, top_logprobs: int = 0,
                     stop_token_ids: list[int] | tuple[int, ...] = ()) -> None:
    """Raises InvalidSampling unless the logits processing a caller asked for is in range (vocab_size None: ids
    are not checked against the vocabulary, the stage checks them against its own)."""
    if not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
        raise InvalidSampling(f"min_p {min_p!r}: use a value in [0, 1] (0: off)")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidSampling(f"{name} {value!r}: use a value in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off)")
    if not (math.isfinite(repetition_penalty) and 0.0 <= repetition_penalty <= MAX_REPETITION_PENALTY):
        raise InvalidSampling(f"repetition_penalty {repetition_penalty!r}: use a value in (0, "
                              f"{MAX_REPETITION_PENALTY:g}] (0 or 1: off)")
    bias = logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidSampling(f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, value in bias.items():
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise InvalidSampling(f"logit_bias: token id {token} is outside the vocabulary 0..{vocab_size - 1}")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidSampling(f"logit_bias of token {token}: {value!r}; use a value in "
                                  f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidSampling(f"top_logprobs {top_logprobs}: use 0..{MAX_TOP_LOGPROBS}")
    if top_logprobs and not logprobs:
        raise InvalidSampling("top_logprobs needs logprobs: set logprobs too")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidSampling(f"stop_token_ids has {len(stop_token_ids)} entries: at most {MAX_STOP_TOKEN_IDS}")
    for token in stop_token_ids:
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise InvalidSampling(f"stop_token_ids: token id {token} is outside the vocabulary 0..{vocab_size - 1}")
