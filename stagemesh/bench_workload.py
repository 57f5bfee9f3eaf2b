"""What `stagemesh bench` sends, and when: prompts and output lengths drawn from chosen distributions (or read
from a JSONL file), and Poisson arrival gaps. Seeded, so two runs with the same --seed send the same requests."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

WORDS = tuple("""the of and to in is was he for it with as his on be at by had are but from or have an they which one
you were her all she there would their we him been has when who will more no if out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our over man
me even most made after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come since against go came
right used take three""".split())
"""Prompts made of words where the router gives no vocabulary size (most are one token in a BPE vocabulary)."""


class LengthDist(NamedTuple):
    """A length drawn per request: `32` or `fixed:32`, `uniform:16:64` (both ends included) or `normal:128:32`
    (mean and standard deviation, rounded, at least 1). A tuple, not a dataclass: a config field of it is one flag
    (stagemesh/config_flags.py flattens a dataclass into flags of its fields)."""

    kind: Literal["fixed", "uniform", "normal"]
    a: int
    b: int = 0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, *numbers = text.split(":") if ":" in text else ("fixed", text)
        try:
            values = [int(n) for n in numbers]
        except ValueError:
            raise ValueError("use N, fixed:N, uniform:LOW:HIGH or normal:MEAN:STDDEV (whole numbers)") from None
        want = {"fixed": 1, "uniform": 2, "normal": 2}
        if kind not in want or len(values) != want[kind]:
            raise ValueError("use N, fixed:N, uniform:LOW:HIGH or normal:MEAN:STDDEV")
        dist = cls(kind, *values)
        if dist.a < 1 or (kind == "uniform" and dist.b < dist.a) or (kind == "normal" and dist.b < 0):
            raise ValueError("lengths are >= 1 (uniform: LOW <= HIGH; normal: STDDEV >= 0)")
        return dist

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.a, self.b)
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.a, self.b)))
        return self.a

    def __str__(self) -> str:
        return str(self.a) if self.kind == "fixed" else f"{self.kind}:{self.a}:{self.b}"


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]
    """Text, or token ids."""
    max_tokens: int
    input_len: int | None
    """Prompt tokens where known (a prompt of token ids), else None (the server's usage may still say)."""


class Workload:
    """The requests of a run, in order: request(i) is the same for every run with the same seed. Synthetic prompts
    are token ids drawn from the vocabulary where vocab_size is known (never an end-of-sequence id), else words;
    a JSONL file's prompts ({"prompt": text or ids, "max_tokens": N}) are sent in its order, from its start again
    when they run out (a line without max_tokens draws it from output_len)."""

    def __init__(self, input_len: LengthDist, output_len: LengthDist, seed: int, *, vocab_size: int = 0,
                 eos_token_ids: Sequence[int] = (), dataset: str | None = None):
        self.input_len, self.output_len = input_len, output_len
        self.vocab_size, self.eos = vocab_size, frozenset(eos_token_ids)
        self.rng = random.Random(seed)
        self.lines = read_dataset(dataset) if dataset else []
        self.made: list[BenchRequest] = []

    @property
    def prompt_unit(self) -> str:
        return "file" if self.lines else "tokens" if self.vocab_size else "words"

    def request(self, i: int) -> BenchRequest:
        while len(self.made) <= i:  # drawn in order, so request i never depends on which were asked for first
            self.made.append(self._next(len(self.made)))
        return self.made[i]

    def _next(self, i: int) -> BenchRequest:
        if self.lines:
            line = self.lines[i % len(self.lines)]
            prompt = line["prompt"]
            ids = not isinstance(prompt, str)
            return BenchRequest(tuple(prompt) if ids else prompt, line.get("max_tokens") or self.output_len.draw(
                self.rng), len(prompt) if ids else None)
        n, max_tokens = self.input_len.draw(self.rng), self.output_len.draw(self.rng)
        if self.vocab_size:
            ids = []
            while len(ids) < n:
                if (token := self.rng.randrange(self.vocab_size)) not in self.eos:
                    ids.append(token)
            return BenchRequest(tuple(ids), max_tokens, n)
        return BenchRequest(" ".join(self.rng.choice(WORDS) for _ in range(n)), max_tokens, None)


def read_dataset(path: str) -> list[dict]:
    """The JSONL file's lines, each checked: ValueError naming the line that is not a prompt."""
    lines = []
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        prompt = line.get("prompt") if isinstance(line, dict) else None
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        max_tokens = line.get("max_tokens") if isinstance(line, dict) else None
        if not (isinstance(prompt, str) and prompt or ids) or not (
                max_tokens is None or isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f'{path}:{number}: want {{"prompt": "text" or [token ids], "max_tokens": N >= 1}} '
                             "(max_tokens optional)")
        lines.append(line)
    if not lines:
        raise ValueError(f"{path}: no prompts")
    return lines


def poisson_gaps(rate: float, rng: random.Random) -> Iterator[float]:
    """Seconds between arrivals of a Poisson process of `rate` per second: exponential gaps of mean 1/rate."""
    while True:
        yield rng.expovariate(rate)
