"""KV-cache memory for a stage's sessions: a paged pool of fixed-size blocks.

The pool is two tensors allocated once, at start, from --kv-cache-gb: K and V for every layer of the
stage, in blocks of `block_size` positions. A session holds a block table (the blocks of its
positions, in order) that grows as it advances; its blocks go back to the pool when it closes, by
whatever path (close, end of its stream, expiry, slice swap). Block 0 is never given out: it stays
zero and pads the gathered views of shorter sessions (garbage there could be NaN, and 0 * NaN is NaN).

Admission counts blocks. OpenSession's max_length is an upper bound (checked against the model's
context), not a reservation: a session reserves what it holds plus a look-ahead of
`lookahead_blocks` (never past its max_length). A session is refused at open when the reservations
of all sessions, its own included, would exceed the pool (RESOURCE_EXHAUSTED: another chain, or later).

When the pool runs dry mid-stream (sessions grew past their look-ahead), the stage preempts, as vLLM
does: the most recently admitted session holding blocks loses them all, and its step (this one, or
its next) answers RESOURCE_EXHAUSTED saying it was preempted to make room. If that session is the
one asking, its own step is the one refused. The router treats RESOURCE_EXHAUSTED as "another
chain, or later" and replays prompt + generated tokens there (recompute), so the stream stays
token-exact. The pool never allocates after start, so it never runs the process out of memory.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch

NULL_BLOCK = 0
"""Reserved, zeroed: pads gathered views; never a session's."""


class PoolExhausted(RuntimeError):
    """The pool has no room for the session; retry elsewhere or later."""


class PoolTooLarge(ValueError):
    """The pool asked for (--kv-cache-gb) is more than the device can hold: a configuration error."""


class Preempted(PoolExhausted):
    """The session lost its blocks to make room for older sessions; replay it elsewhere or later."""


@dataclass(eq=False)
class SessionCache:
    pool: KVPool = field(repr=False)
    max_length: int  # positions it may reach (an upper bound, not a reservation)
    order: int  # admission order: the newest is preempted first
    blocks: list[int] = field(default_factory=list)  # its block table: position p is in blocks[p // block_size]
    # Positions already filled; the next step must start here.
    length: int = 0
    preempted: bool = False

    @property
    def capacity(self) -> int:
        return self.max_length


class KVPool:
    def __init__(self, capacity_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", block_size: int = 16, lookahead_blocks: int = 4):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.block_size, self.lookahead_blocks = block_size, lookahead_blocks
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize
        self.num_blocks = max(2, capacity_bytes // self.block_bytes)  # block 0 is the null block
        slots = self.num_blocks * block_size
        available = psutil.virtual_memory().available if self.device.type == "cpu" else None
        if available is not None and self.num_blocks * self.block_bytes > available:
            raise PoolTooLarge(f"a KV pool of {capacity_bytes / 2**30:.1f} GiB is more than the "
                               f"{available / 2**30:.1f} GiB of memory available on this host; start the stage "
                               "with a smaller --kv-cache-gb (or none: a quarter of what is available)")
        try:
            # k, v: [num_layers_in_stage, num_blocks * block_size, num_kv_heads, head_dim]; slot = block * bs + offset.
            # Slot-major: a position's K (or V) for every kv head is one row, a block one run of memory, which the
            # paged attention kernel (paged_attention.cpp) reads in place.
            self.k = torch.empty(num_layers, slots, num_kv_heads, head_dim, dtype=dtype, device=self.device)
            self.v = torch.empty_like(self.k)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            raise PoolTooLarge(f"the device could not hold a KV pool of {capacity_bytes / 2**30:.1f} GiB "
                               f"({type(exc).__name__}); start the stage with a smaller --kv-cache-gb") from None
        self.k[:, :block_size].zero_()
        self.v[:, :block_size].zero_()
        self.free: list[int] = list(range(self.num_blocks - 1, NULL_BLOCK, -1))  # pop() gives the lowest
        self.caches: dict[int, SessionCache] = {}  # live ones, by id()
        self.preemptions = 0
        self.peak_blocks_used = 0
        self._order = itertools.count()
        self._lock = threading.Lock()  # closes come from the event loop, growth from the compute thread
        self._in_pass: set[int] = set()  # caches the running pass reads, by id(): closed, they keep their blocks
        self._closed_in_pass: list[SessionCache] = []
        # Per-pass scratch (model.py): gathered K or V of a pass, reused by every layer and pass.
        self.scratch_k = torch.empty(0, dtype=dtype, device=self.device)
        self.scratch_v = torch.empty_like(self.scratch_k)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def blocks_used(self) -> int:
        return self.usable_blocks - len(self.free)

    @property
    def used_bytes(self) -> int:
        return self.blocks_used * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.usable_blocks * self.block_bytes

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def bytes_for(self, positions: int) -> int:
        return self.blocks_for(positions) * self.block_bytes

    def _reservation(self, cache: SessionCache) -> int:
        return min(self.blocks_for(cache.max_length), len(cache.blocks) + self.lookahead_blocks)

    def allocate(self, max_length: int) -> SessionCache:
        """Admits a session (no block is taken yet): refused when the reservations would pass the pool."""
        with self._lock:
            cache = SessionCache(self, max_length, next(self._order))
            reserved = sum(self._reservation(c) for c in self.caches.values())
            need = self._reservation(cache)
            if reserved + need > self.usable_blocks:
                raise PoolExhausted(
                    f"KV pool full: {reserved} of {self.usable_blocks} blocks of {self.block_size} positions are "
                    f"held or reserved and a new session reserves {need}; retry on another chain or later, or "
                    "start the stage with a larger --kv-cache-gb")
            self.caches[id(cache)] = cache
            return cache

    def grow(self, cache: SessionCache, end: int) -> list[SessionCache]:
        """Gives cache the blocks for positions [0, end), preempting the newest sessions while the pool is
        dry. Returns the sessions preempted; raises Preempted if cache itself was the one."""
        with self._lock:
            if cache.preempted:
                raise Preempted(PREEMPTED)
            if id(cache) not in self.caches:
                raise PoolExhausted("the session was closed")
            victims = []
            while len(cache.blocks) < self.blocks_for(end):
                if not self.free:
                    victim = max((c for c in self.caches.values() if c.blocks), key=lambda c: c.order)
                    self._preempt(victim)
                    victims.append(victim)
                    if victim is cache:
                        raise Preempted(PREEMPTED)
                    continue
                cache.blocks.append(self.free.pop())
            self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used)
            return victims

    def trim(self, cache: SessionCache) -> None:
        """Returns the blocks past cache.length (a step that failed took them)."""
        with self._lock:
            keep = self.blocks_for(cache.length)
            self.free.extend(reversed(cache.blocks[keep:]))
            del cache.blocks[keep:]

    def _give_back(self, cache: SessionCache) -> None:
        self.free.extend(reversed(cache.blocks))
        cache.blocks.clear()

    def _preempt(self, cache: SessionCache) -> None:
        self._give_back(cache)
        cache.preempted = True
        self.preemptions += 1

    def release(self, cache: SessionCache) -> None:
        with self._lock:
            if self.caches.pop(id(cache), None) is None:
                return
            if id(cache) in self._in_pass:
                self._closed_in_pass.append(cache)  # its blocks go back when the pass ends
            else:
                self._give_back(cache)

    @contextmanager
    def reading(self, caches: Iterable[SessionCache]) -> Iterator[None]:
        """While a pass reads these caches' block tables (the compute thread; a tensor-parallel stage also sends
        them to its ranks), a session closed on the event loop keeps its blocks: every reader of the pass sees one
        table, and no block goes back to the pool while the pass may still write it."""
        with self._lock:
            self._in_pass = {id(c) for c in caches}
        try:
            yield
        finally:
            with self._lock:
                self._in_pass = set()
                for cache in self._closed_in_pass:
                    self._give_back(cache)
                self._closed_in_pass.clear()

    def slots(self, cache: SessionCache, start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end) of cache."""
        bs, blocks = self.block_size, cache.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two contiguous [kvH, n, D] buffers for a pass's gathered K and V, grown (doubling), then reused."""
        need = self.num_kv_heads * n * self.head_dim
        if self.scratch_k.numel() < need:
            self.scratch_k = torch.empty(max(need, 2 * self.scratch_k.numel()), dtype=self.dtype, device=self.device)
            self.scratch_v = torch.empty_like(self.scratch_k)
        shape = (self.num_kv_heads, n, self.head_dim)
        return self.scratch_k[:need].view(shape), self.scratch_v[:need].view(shape)


PREEMPTED = ("this session was preempted to make room in the stage's KV pool (the newest session yields first); "
             "replay it on another chain or later")
