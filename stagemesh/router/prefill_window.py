"""A long prompt's prefill chunks, sent only a bounded number ahead of the chain's end.

Sent all at once, every chunk's hidden states would pile up in front of the chain's slowest stage (held by the
stage before it, or queued on the link between them). Instead a step's chunks go out `ahead` at a time: each
chunk but the prompt's last is sent with ForwardRequest.ack, the last stage answers it (ForwardResponse.ack) once
it has run through the whole chain, and each answer lets one more chunk go. `ahead` is a few chunks a stage, so
that every stage still has a chunk to work on while the others work on theirs (the pipelining is kept)."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

AHEAD_PER_STAGE = 2
"""Chunks in flight per stage of the chain: one being computed there, one on its way to it."""


class Chunk(NamedTuple):
    start: int
    """The chunk's first position in the session."""
    token_ids: list[int]
    last: bool
    """The step's last chunk (the one that samples): sent without ack, answered with the step's result."""


def chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """Positions start..end-1 as [a, b) pieces of at most size (0: one piece): the one chunker of prefills,
    of the router's steps and of a repair's rebuild."""
    size = size or max(1, end - start)
    return [(a, min(end, a + size)) for a in range(start, end, size)]


class PrefillWindow:
    """One step's chunks not yet sent, and how many sent are not yet acknowledged by the last stage."""

    def __init__(self, start: int, token_ids: list[int], chunk_size: int, stages: int):
        end = start + len(token_ids)
        self.ahead = max(1, AHEAD_PER_STAGE * stages)
        self.pending: deque[Chunk] = deque(Chunk(a, token_ids[a - start: b - start], b == end)
                                           for a, b in chunks(start, end, chunk_size))
        self.in_flight = 0

    def take(self) -> list[Chunk]:
        """The chunks that may be sent now (counted in flight)."""
        out = []
        while self.pending and self.in_flight < self.ahead:
            out.append(self.pending.popleft())
            self.in_flight += not out[-1].last
        return out

    def acked(self) -> list[Chunk]:
        """A chunk reached the chain's end: the chunks that may follow it now."""
        self.in_flight = max(0, self.in_flight - 1)
        return self.take()
