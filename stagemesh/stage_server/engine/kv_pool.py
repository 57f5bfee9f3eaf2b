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

Prefix caching (as vLLM's and SGLang's): a session opened with the tokens it starts with (its router sends
them, with a salt naming what else this stage's inputs depend on: the stages before it and the wire dtype)
gets a key per full block of them, each key a hash of the salt, the key before it and the block's tokens.
Once a block is computed (the session's length passed it), it is registered under its key; a later session
whose keys match attaches those blocks at open instead of computing them, shared, read-only: a step writes
only positions past its session's length, and an attached block lies wholly before it. A block is freed
when no session holds it, but stays indexed (evictable, least recently used first) until the pool needs it:
evicting a cached block comes before preempting a session. A block's holders count once for admission.
The first stage sees the tokens a session is stepped with: a block is registered there only if the tokens computed
into it are the ones its key claims (check_tokens), so no caller can plant KV under another prompt's keys; the stages
after it cannot check (their inputs are hidden states), but a chain starts where every stage has its blocks, and the
first stage has none but true ones.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch

from stagemesh.stage_server.cpu import huge_pages

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
    prefix_keys: list[bytes] = field(default_factory=list, repr=False)
    """Prefix caching: the key of each full block of the tokens it was opened with (block i: positions
    i * block_size onward); its blocks are registered under them as they are computed."""
    claimed: list[int] = field(default_factory=list, repr=False)
    """The tokens its prefix_keys stand for (block_size per key): what check_tokens compares a step's tokens with."""
    attached: int = 0
    """Positions attached from the prefix cache at open (0: none); until its first step, all it holds."""
    registered: int = 0
    """Its leading full blocks already offered to the prefix index: each is looked at once, not at every step."""

    @property
    def capacity(self) -> int:
        return self.max_length

    def block_table(self, width: int) -> list[int]:
        """Its first `width` blocks, padded with NULL_BLOCK to that width: its row of a pass's block tables."""
        return self.blocks[:width] + [NULL_BLOCK] * (width - len(self.blocks[:width]))


class KVPool:
    def __init__(self, capacity_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", block_size: int = 16, lookahead_blocks: int = 4,
                 huge: bool = True):
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
            # On the CPU with huge, on 2 MiB pages: decode attention streams the pool (huge_pages.py).
            shape = (num_layers, slots, num_kv_heads, head_dim)
            if self.device.type == "cpu":
                self.k, self.v = huge_pages.zeros(shape, dtype, huge), huge_pages.zeros(shape, dtype, huge)
            else:
                self.k = torch.empty(shape, dtype=dtype, device=self.device)
                self.v = torch.empty_like(self.k)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError, OSError) as exc:
            raise PoolTooLarge(f"the device could not hold a KV pool of {capacity_bytes / 2**30:.1f} GiB "
                               f"({type(exc).__name__}); start the stage with a smaller --kv-cache-gb") from None
        self.k[:, :block_size].zero_()
        self.v[:, :block_size].zero_()
        self.free: list[int] = list(range(self.num_blocks - 1, NULL_BLOCK, -1))  # pop() gives the lowest
        self.caches: dict[int, SessionCache] = {}  # live ones, by id()
        self.preemptions = 0
        self.peak_blocks_used = 0
        self.refs = [0] * self.num_blocks  # sessions holding each block
        self.cached: dict[bytes, int] = {}  # prefix key -> block holding it
        self.key_of: dict[int, bytes] = {}  # block -> its prefix key (registered blocks only)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none: oldest use first
        self.prefix_hit_positions = 0  # positions attached from the prefix cache since start
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
        """Blocks sessions hold (cached blocks no session holds are free to take)."""
        return self.usable_blocks - len(self.free) - len(self.evictable)

    @property
    def cached_blocks(self) -> int:
        """Blocks indexed by the prefix cache, held or not."""
        return len(self.cached)

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

    def prefix_keys(self, token_ids: list[int], salt: str) -> list[bytes]:
        """The key of each full block of token_ids (prefix caching): a hash of the salt, the key before it
        and the block's tokens."""
        keys, key, bs = [], hashlib.blake2b(salt.encode(), digest_size=16).digest(), self.block_size
        for at in range(0, len(token_ids) - bs + 1, bs):
            key = hashlib.blake2b(key + array("q", token_ids[at: at + bs]).tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def allocate(self, max_length: int, prefix_keys: list[bytes] | None = None,
                 claimed: list[int] | None = None) -> SessionCache:
        """Admits a session, attaching the cached blocks its prefix_keys lead with (no other block is taken
        yet): refused when the reservations would pass the pool. claimed: the tokens the keys stand for."""
        with self._lock:
            cache = SessionCache(self, max_length, next(self._order), prefix_keys=list(prefix_keys or ()),
                                 claimed=list((claimed or [])[: len(prefix_keys or ()) * self.block_size]))
            attach = []
            for key in cache.prefix_keys[: (max_length - 1) // self.block_size]:  # a position is left to compute
                if (block := self.cached.get(key)) is None:
                    break
                attach.append(block)
            held = self.blocks_used + sum(1 for b in attach if not self.refs[b])
            extra = sum(self._reservation(c) - len(c.blocks) for c in self.caches.values())
            need = min(self.blocks_for(max_length), len(attach) + self.lookahead_blocks) - len(attach)
            if held + extra + need > self.usable_blocks:
                raise PoolExhausted(
                    f"KV pool full: {held + extra} of {self.usable_blocks} blocks of {self.block_size} positions "
                    f"are held or reserved and a new session reserves {need}; retry on another chain or later, "
                    "or start the stage with a larger --kv-cache-gb")
            for block in attach:
                self._take(block)
            cache.blocks = attach
            cache.registered = len(attach)
            cache.length = cache.attached = len(attach) * self.block_size
            self.prefix_hit_positions += cache.attached
            self.caches[id(cache)] = cache
            self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used)
            return cache

    def check_tokens(self, cache: SessionCache, start: int, token_ids: list[int]) -> None:
        """The first stage, before a step's pass: if the step's tokens differ from those cache's keys claim for
        positions start onward, the keys from the first block that differs are dropped (a later block's key chains
        through it), so what this session computes there is never registered under another prompt's keys."""
        end = min(start + len(token_ids), len(cache.claimed))
        if start >= end or token_ids[: end - start] == cache.claimed[start:end]:
            return
        differs = next(p for p in range(start, end) if token_ids[p - start] != cache.claimed[p])
        with self._lock:
            keep = min(len(cache.prefix_keys), differs // self.block_size)
            del cache.prefix_keys[keep:]
            del cache.claimed[keep * self.block_size:]

    def rewind(self, cache: SessionCache, position: int) -> None:
        """cache keeps positions 0..position-1 and lets go of the blocks past them: a first step that starts
        before the positions attached at open (the chain's other stages had fewer cached), a failed step, or a
        repair's rewind. A block it keeps in part becomes its own, since it writes the rest of it again: out of
        the index if only the index has it, copied if another session holds it too (the router's starts lie on
        block boundaries, so that is rare)."""
        with self._lock:
            self._register(cache)  # what it computed stays for the sessions that start the same way
            keep, bs = self.blocks_for(position), self.block_size
            for block in reversed(cache.blocks[keep:]):  # the last first: the LRU evicts a prefix's tail first
                self._drop(block)
            del cache.blocks[keep:]
            cache.registered = min(cache.registered, position // bs)  # a block kept in part is offered again
            if cache.attached > position:
                self.prefix_hit_positions -= cache.attached - position  # attached, then not used
                cache.attached = position
            cache.length = min(cache.length, position)
            last = cache.blocks[-1] if cache.blocks else NULL_BLOCK
            if position % bs and self.refs[last] == 1 and last in self.key_of:  # its own: out of the index
                del self.cached[self.key_of.pop(last)]
            elif position % bs and self.refs[last] > 1:
                if (own := self._fresh()) is None:  # no room for its own copy: it can only be replayed
                    self._preempt(cache)
                    raise Preempted(PREEMPTED)
                self.k[:, own * bs: (own + 1) * bs] = self.k[:, last * bs: (last + 1) * bs]
                self.v[:, own * bs: (own + 1) * bs] = self.v[:, last * bs: (last + 1) * bs]
                self._drop(last)
                cache.blocks[-1] = own

    def _take(self, block: int) -> None:
        """A session holds block (a cached one no session held leaves the evictable list)."""
        if not self.refs[block]:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _drop(self, block: int) -> None:
        """A session lets go of block: once no session holds it, it is free, or evictable if cached."""
        self.refs[block] -= 1
        if not self.refs[block]:
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def _fresh(self) -> int | None:
        """A block for a session to write: a free one, else the least recently used cached one (unindexed),
        else None (the pool is dry)."""
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block = self._evict_oldest()
        else:
            return None
        self.refs[block] = 1
        return block

    def forget_cached(self) -> int:
        """Drops every cached block no session holds from the index (vLLM's reset_prefix_cache): a benchmark or a
        test starts from a cold cache without a new stage. Returns how many went."""
        with self._lock:
            dropped = len(self.evictable)
            while self.evictable:
                self.free.append(self._evict_oldest())
            return dropped

    def _evict_oldest(self) -> int:
        """The least recently used cached block no session holds, taken out of the prefix index."""
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.key_of.pop(block)]
        return block

    def _register(self, cache: SessionCache) -> None:
        """Indexes cache's computed full blocks under its prefix keys (first come, first kept)."""
        done = min(len(cache.prefix_keys), cache.length // self.block_size, len(cache.blocks))
        for i in range(cache.registered, done):
            key, block = cache.prefix_keys[i], cache.blocks[i]
            if key not in self.cached and block not in self.key_of:
                self.cached[key] = block
                self.key_of[block] = key
        cache.registered = max(cache.registered, done)

    def grow(self, cache: SessionCache, end: int) -> list[SessionCache]:
        """Gives cache the blocks for positions [0, end), preempting the newest sessions while the pool is
        dry. Returns the sessions preempted; raises Preempted if cache itself was the one."""
        with self._lock:
            if cache.preempted:
                raise Preempted(PREEMPTED)
            if id(cache) not in self.caches:
                raise PoolExhausted("the session was closed")
            self._register(cache)
            victims = []
            while len(cache.blocks) < self.blocks_for(end):
                if (block := self._fresh()) is None:
                    # The newest that frees a block (one whose blocks all have other holders frees none).
                    freeing = [c for c in self.caches.values() if any(self.refs[b] == 1 for b in c.blocks)]
                    if not freeing:
                        raise PoolExhausted("KV pool full: every block is held by sessions that share it; retry later")
                    victim = max(freeing, key=lambda c: c.order)
                    self._preempt(victim)
                    victims.append(victim)
                    if victim is cache:
                        raise Preempted(PREEMPTED)
                    continue
                cache.blocks.append(block)
            self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used)
            return victims

    def _give_back(self, cache: SessionCache) -> None:
        cache.registered = cache.attached // self.block_size  # at its end, each block is offered once more
        self._register(cache)  # what it computed stays for the sessions that start the same way
        for block in reversed(cache.blocks):
            self._drop(block)
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
        table, and no block goes back to the pool while the pass may still write it. When the pass ends, the full
        blocks it computed are registered for prefix caching at once, before its results go out: a session that
        opens with the same tokens right after a step's answer finds them (not at that session's next step or close,
        which may come later)."""
        caches = list(caches)
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
                for cache in caches:
                    if id(cache) in self.caches:
                        self._register(cache)

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
