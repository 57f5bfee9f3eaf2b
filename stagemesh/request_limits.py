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
