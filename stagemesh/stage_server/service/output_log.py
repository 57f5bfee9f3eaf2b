"""Repair: a session's output log, the hidden states a stage sent on for every position it processed.

When the next stage of a chain dies, a stage that serves the same range takes its place: the router
reads this log (Stage/ReadOutput) and sends it to the new stage as prefill chunks, which rebuilds its
KV cache exactly (the same inputs as the dead stage had, position for position). Only sessions opened
with keep_output keep one, only on stages that have a next stage, and all logs together stay within
--output-log-gb: a session whose log would not fit loses it (and can only be replayed, not repaired).
The log is freed when its session closes, by whatever path."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from stagemesh.errors import StatusError


class LogBudget:
    """Bytes that the stage's output logs may hold together."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.dropped = 0  # logs given up for lack of room since start

    def take(self, nbytes: int) -> bool:
        if self.used_bytes + nbytes > self.capacity_bytes:
            return False
        self.used_bytes += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.used_bytes -= nbytes


class OutputLog:
    """A growing buffer of output rows, [length, hidden] (capacity doubles, within the budget)."""

    def __init__(self, budget: LogBudget):
        self.budget = budget
        self.rows: torch.Tensor | None = None  # [capacity, hidden]
        self.length = 0  # positions logged: 0..length-1
        self.lost = False  # dropped (no room, or a gap): the session cannot be repaired from here

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes

    def append(self, start: int, hidden: torch.Tensor) -> None:
        """hidden: [n, hidden], the output of positions start..start+n-1."""
        if self.lost:
            return
        if start != self.length:
            self.drop()
            return
        end = start + hidden.shape[0]
        if self.rows is None or end > self.rows.shape[0]:
            capacity = max(end, 16 if self.rows is None else 2 * self.rows.shape[0])
            grown = torch.empty(capacity, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            if not self.budget.take(grown.nbytes):
                self.drop()
                self.budget.dropped += 1
                return
            if self.rows is not None:
                grown[: self.length] = self.rows[: self.length]
                self.budget.give(self.rows.nbytes)
            self.rows = grown
        self.rows[start:end] = hidden
        self.length = end

    def read(self, start: int, end: int, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(position, rows) for positions start..end-1, at most chunk rows at a time (check covers() first)."""
        rows = self.rows  # the session may close meanwhile: what was read stays readable
        for at in range(start, end, chunk):
            yield at, rows[at: min(end, at + chunk)]

    def covers(self, start: int, end: int) -> bool:
        return not self.lost and 0 <= start <= end <= self.length

    def drop(self) -> None:
        """Frees the log (the session closed, or the log cannot be kept)."""
        self.lost = True
        if self.rows is not None:
            self.budget.give(self.rows.nbytes)
            self.rows = None


def readable(output: OutputLog | None, start: int, end: int, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Stage/ReadOutput: (position, rows) of positions start..end-1, chunk rows at a time (0: all at once);
    FAILED_PRECONDITION when the session's log does not hold them."""
    if output is None or not output.covers(start, end):
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this stage holds no output log of positions {start}..{end - 1} for the session (not "
                          "asked for at open, or dropped for lack of --output-log-gb)")
    return output.read(start, end, chunk or max(1, end - start))
