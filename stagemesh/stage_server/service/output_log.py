"""Repair: a session's output log, the hidden states a stage sent on for every position it processed.

When the next stage of a chain dies, a stage that serves the same range takes its place: the router
reads this log (Stage/ReadOutput) and sends it to the new stage as prefill chunks, which rebuilds its
KV cache exactly (the same inputs as the dead stage had, position for position). Only sessions opened
with keep_output keep one, only on stages that have a next stage.

All logs live in one RepairLog, allocated once at start (--repair-log-tokens positions; by default as many as
the KV pool holds, so every position a session can reach can be logged) in chunks of fixed size, as the KV pool
is in blocks: a session takes chunks as it grows and gives them back when it closes, so that logs never
fragment the device nor allocate mid-stream. The batcher writes each pass's rows on the compute thread, from the
device's copy where the log lies on the device (a copy in the pass's stream order, which waits neither for the
host nor for later passes), while the event loop reads and frees logs: one lock orders them. A session whose log
cannot be kept (no free chunk, or a step that does not continue it) loses it, is counted
(stagemesh_stage_output_log_dropped_total{reason}) and logged once, and can only be replayed, not repaired."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc
import psutil
import torch

from stagemesh import metrics
from stagemesh.errors import StatusError
from stagemesh.stage_server.engine.kv_pool import PoolTooLarge

log = logging.getLogger("stagemesh.stage")

FULL = "full"
"""Dropped: no free chunk was left for the session's next positions (--repair-log-tokens)."""
GAP = "gap"
"""Dropped: a step did not continue the log (its session started past position 0, from the prefix cache)."""


class RepairLog:
    """The stage's output-log memory: `tokens` positions of hidden states in chunks of `chunk_tokens`, allocated
    once on `device` (pinned host memory where CUDA is available and the device is the CPU)."""

    def __init__(self, tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 chunk_tokens: int = 16):
        self.chunk_tokens = chunk_tokens
        self.device = torch.device(device)
        self.pinned = self.device.type == "cpu" and torch.cuda.is_available()
        num_chunks = -(-tokens // chunk_tokens)
        self.chunk_bytes = chunk_tokens * hidden_size * torch.empty((), dtype=dtype).element_size()
        if self.device.type == "cpu" and num_chunks * self.chunk_bytes > psutil.virtual_memory().available:
            raise PoolTooLarge(f"a repair log of {tokens} tokens ({num_chunks * self.chunk_bytes / 2**30:.1f} GiB) is "
                               "more than the memory available on this host; start the stage with a smaller "
                               "--repair-log-tokens")
        try:
            self.rows = torch.empty(num_chunks * chunk_tokens, hidden_size, dtype=dtype, device=self.device,
                                    pin_memory=self.pinned)  # chunk c: rows c * chunk_tokens onward
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            raise PoolTooLarge(f"the {'pinned host memory' if self.pinned else self.device} could not hold a repair "
                               f"log of {tokens} tokens ({type(exc).__name__}); start the stage with a smaller "
                               "--repair-log-tokens") from None
        self.free = list(range(num_chunks - 1, -1, -1))  # popped from the end: chunk 0 first
        self.num_chunks = num_chunks
        self.dropped = 0  # logs given up since start, for any reason
        self.lock = threading.RLock()  # the compute thread appends; the event loop reads and drops

    @property
    def capacity_tokens(self) -> int:
        return self.num_chunks * self.chunk_tokens

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_chunks - len(self.free)) * self.chunk_bytes

    @property
    def where(self) -> str:
        """Where the rows live, as the start-up log says it."""
        if self.device.type != "cpu":
            return f"on {self.device}"
        return "in pinned host memory" if self.pinned else "in host memory"

    def take(self, n: int) -> list[int] | None:
        """n free chunks, or None (and none taken) when fewer are left."""
        if n > len(self.free):
            return None
        taken = self.free[len(self.free) - n:]
        del self.free[len(self.free) - n:]
        return taken

    def give(self, chunks: list[int]) -> None:
        self.free.extend(chunks)


class OutputLog:
    """One session's log: its chunks of the RepairLog, in position order (position p in chunks[p // chunk])."""

    def __init__(self, budget: RepairLog, session_label: dict[str, str] | None = None):
        self.budget = budget
        self.chunks: list[int] = []
        self.length = 0  # positions logged: 0..length-1 (a rewind lowers it; the chunks past it are reused)
        self.lost = False  # dropped (no room, or a gap): the session cannot be repaired from here
        self.label = session_label or {}  # the session and request ids its log line names

    @property
    def nbytes(self) -> int:
        return len(self.chunks) * self.budget.chunk_bytes

    def append(self, start: int, hidden: torch.Tensor) -> None:
        """hidden: [n, hidden], the output of positions start..start+n-1 (on the compute thread)."""
        with self.budget.lock:
            self._append(start, hidden)

    def _append(self, start: int, hidden: torch.Tensor) -> None:
        if self.lost:
            return
        if start != self.length:
            self._give_up(GAP, f"a step at position {start} does not continue the log (0..{self.length - 1}): the "
                               "session started from prefix-cached positions, which no next stage can be rebuilt from")
            return
        end = start + hidden.shape[0]
        size = self.budget.chunk_tokens
        more = -(-end // size) - len(self.chunks)
        if more > 0:
            taken = self.budget.take(more)
            if taken is None:
                self._give_up(FULL, f"no room for positions {start}..{end - 1}: the stage's repair log holds "
                                    f"{self.budget.capacity_tokens} tokens (--repair-log-tokens), "
                                    f"{len(self.budget.free) * size} of them free")
                return
            self.chunks.extend(taken)
        rows = self.budget.rows
        for at, upto, slot in self._runs(start, end):  # one copy per chunk touched
            rows[slot: slot + upto - at] = hidden[at - start: upto - start]
        self.length = end

    def read(self, start: int, end: int, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(position, rows) for positions start..end-1, at most chunk rows at a time, each a copy (its chunks may
        be another session's once this one closes); FAILED_PRECONDITION if the log is dropped meanwhile."""
        for at in range(start, end, chunk):
            upto = min(end, at + chunk)
            with self.budget.lock:
                if not self.covers(at, upto):
                    raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, "the session's output log was dropped "
                                                                           f"while positions {at}..{end - 1} were read")
                rows = self.rows_of(at, upto)
            yield at, rows

    def rows_of(self, start: int, end: int) -> torch.Tensor:
        """A copy of the rows of positions start..end-1 (covered)."""
        rows = self.budget.rows
        pieces = [rows[slot: slot + upto - at] for at, upto, slot in self._runs(start, end)]
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0].clone()

    def _runs(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(at, upto, slot): positions start..end-1 cut at chunk bounds, each run's first row in the RepairLog."""
        size = self.budget.chunk_tokens
        at = start
        while at < end:
            upto = min(end, (at // size + 1) * size)
            yield at, upto, self.chunks[at // size] * size + at % size
            at = upto

    def covers(self, start: int, end: int) -> bool:
        return not self.lost and 0 <= start <= end <= self.length

    def drop(self) -> None:
        """Frees the log (the session closed, or the log cannot be kept)."""
        with self.budget.lock:
            self.lost = True
            self.budget.give(self.chunks)
            self.chunks = []

    def _give_up(self, reason: str, why: str) -> None:
        """Drops the log for a reason, counted and logged (once: a dropped log takes no more steps)."""
        self.drop()
        self.budget.dropped += 1
        metrics.OUTPUT_LOG_DROPPED.labels(reason).inc()
        # full is the operator's to fix (--repair-log-tokens); a gap is what the prefix cache does, said quietly
        log.log(logging.WARNING if reason == FULL else logging.INFO,
                f"output log dropped ({reason}): {why}; if the next stage fails, the session is replayed, not "
                "repaired", extra=self.label)


def readable(output: OutputLog | None, start: int, end: int, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Stage/ReadOutput: (position, rows) of positions start..end-1, chunk rows at a time (0: all at once);
    FAILED_PRECONDITION when the session's log does not hold them."""
    if output is None or not output.covers(start, end):
        why = ("not asked for at open, or --repair-log-tokens 0" if output is None
               else "dropped: see the stage's log" if output.lost else f"it holds positions 0..{output.length - 1}")
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this stage holds no output log of positions {start}..{end - 1} for the session ({why})")
    return output.read(start, end, chunk or max(1, end - start))
