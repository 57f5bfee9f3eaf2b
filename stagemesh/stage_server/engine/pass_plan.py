"""What one forward pass needs besides its inputs, built once per pass and shared by every layer.

A pass is a flat batch of many sessions' steps, [T, hidden]. Its plan holds the rotary tables of the
tokens' positions, the pool slots their K/V go to, and its attention groups. With the paged attention
kernel (paged_attention.py) every decode step of the pass is in one group, attended in place through
the sessions' block tables ([B, nb], and each one's end). Without it, the decode steps are in up to four
groups of similar lengths (one SDPA call per group and layer: queries [B, kvH, group, D]). All prefill
chunks are in another (queries padded to the longest chunk, [B, H, Lq, D]). An SDPA group's keys are
gathered from the pool into a padded [B, kvH, Lk, D] view (one index_select per layer into a scratch
buffer the pool keeps), and its boolean masks (causal, the session's length, a sliding window) are made
once per window size, not per layer. Padding keys read the pool's zeroed null block; padding query rows
see key 0 only (never an all-masked row, which would give NaN).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from stagemesh.stage_server.engine.kv_pool import NULL_BLOCK, KVPool, SessionCache

DecodeAttention = Callable[..., torch.Tensor]
"""The paged attention kernel (paged_attention.py): (q [B, H, D], k [slots, kvH, D], v, table [B, nb] int64,
ends [B] int64, block_size, window (0: none), scale) -> [B, H, D], each session's query over its keys
[max(0, end - window), end)."""

MAX_DECODE_GROUPS = 4
"""SDPA calls per layer for a pass's decode steps, at most (see length_buckets)."""
MAX_DECODE_PADDING = 1.25
"""Keys gathered for a group of decode steps, at most this many times the keys they attend over (but see
MAX_DECODE_GROUPS)."""


INT_TYPES = {"q": torch.int64, "i": torch.int32, "B": torch.bool}


def int_tensor(values: Iterable[int], device: torch.device, dtype: str = "q") -> torch.Tensor:
    """A 1-D int64 tensor of values (dtype "i": int32, "B": bool) on device. torch.tensor of a Python list infers
    its type element by element (~0.1 us each: 84 us for a 700-int table); through an array it is one copy
    (~11 us). On CUDA through pinned memory, without waiting: a copy from pageable memory waits for the stream,
    so one made mid-pass (the last stage's rows for the head) would stall the host until the layers before it ran.
    The caching host allocator keeps the pinned buffer until the copy is done."""
    packed, torch_dtype = array(dtype, values), INT_TYPES[dtype]
    if not packed:
        return torch.empty(0, dtype=torch_dtype, device=device)
    t = torch.frombuffer(packed, dtype=torch_dtype)  # keeps packed alive
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    pinned = torch.empty(len(packed), dtype=torch_dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


@dataclass
class StepSlice:
    """One session's part of a flat batch: tokens [offset, offset+length) at positions start...

    cache.length == start when the pass begins, and the cache holds blocks up to start + length;
    the pass writes K/V for the new positions.
    """

    cache: SessionCache
    offset: int
    start: int
    length: int


@dataclass
class AttentionGroup:
    """Steps attended together in one SDPA call per layer."""

    size: int  # B, sessions
    q_len: int  # Lq: 1 for decode steps, else the longest chunk
    k_len: int  # Lk: the longest end
    rows: torch.Tensor  # [B * Lq] the rows of the flat batch holding its queries (padding: the step's first)
    valid: torch.Tensor | None  # [B * Lq] which of those are real queries (None: all)
    gather: torch.Tensor | None  # [B * Lk] pool slots of its keys, for SDPA (None: attended through table)
    table: torch.Tensor | None  # [B, nb] block tables, padded with NULL_BLOCK, for the paged attention kernel
    q_pos: torch.Tensor  # [B, Lq] query positions (padding: 0)
    ends: torch.Tensor  # [B] one past each session's last position
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # by window: [B, Lq, Lk]
    # (None: no mask; for a chunk, causal)

    def mask(self, window: int | None) -> torch.Tensor | None:
        if window not in self.masks:
            self.masks[window] = self._make_mask(window)
        return self.masks[window]

    def _make_mask(self, window: int | None) -> torch.Tensor | None:
        windowed = window is not None and window < self.k_len
        if self.q_len == 1 and not windowed and bool((self.ends == self.k_len).all()):
            return None  # decode steps of equal length: every key is visible
        if self.size == 1 and self.q_len == self.k_len and not windowed:
            return None  # one chunk from position 0: plain causal attention (SDPA's is_causal)
        k_pos = torch.arange(self.k_len, device=self.q_pos.device)
        mask = k_pos[None, None, :] <= self.q_pos[:, :, None]  # [B, Lq, Lk]
        if windowed:
            mask &= self.q_pos[:, :, None] - k_pos[None, None, :] < window
        return mask


@dataclass
class PagedBatch:
    """A pass's sessions as the ragged paged attention kernel reads them (triton_attention.py), built once per
    pass and used by every layer.

    tables [B, nb] int32: each session's block table (padding: the null block, never read); seq_row0 [B]: the
    row of the pass where its queries begin; seq_qlen [B]: how many (1 for a decode step); seq_start [B]: the
    position of its first query (its cache length before the pass). Tiles: up to block_q consecutive queries
    of one session each (tile_seq [n], tile_q0 [n]).
    """

    tables: torch.Tensor
    seq_row0: torch.Tensor
    seq_qlen: torch.Tensor
    seq_start: torch.Tensor
    tile_seq: torch.Tensor
    tile_q0: torch.Tensor
    block_q: int
    max_keys: int  # the longest session's keys (at most): sizes the key splits
    splits: int = 1  # programs that share one tile's keys (key_splits)


def key_splits(tiles: int, kv_heads: int, max_keys: int, device: torch.device, block_n: int = 64) -> int:
    """How many programs of the ragged kernel share one tile's keys: on CUDA enough for about two programs per
    streaming multiprocessor, none holding fewer than 4 blocks of block_n keys (their partial results are merged
    by log-sum-exp after); elsewhere 1."""
    if device.type != "cuda":
        return 1
    programs = max(1, tiles * kv_heads)
    want = -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // programs)
    return max(1, min(want, max_keys // (4 * block_n), 16))


RaggedAttention = Callable[..., torch.Tensor]
"""The ragged paged attention kernel (triton_attention.paged_attention): (q [T, H, D], k [slots, kvH, D], v,
PagedBatch, block_size, window (0: none), scale) -> [T, H, D], each row over its session's keys up to its
position."""


def paged_batch(steps: list[StepSlice], pool: KVPool, device: torch.device) -> PagedBatch:
    """The pass's steps as the ragged kernel reads them: one int32 tensor on the device, viewed seven ways."""
    block_q = 1 if all(st.length == 1 for st in steps) else 16
    n, width = len(steps), pool.blocks_for(max(st.start + st.length for st in steps))
    tile_seq, tile_q0 = [], []
    for b, st in enumerate(steps):
        for q0 in range(0, st.length, block_q):
            tile_seq.append(b)
            tile_q0.append(q0)
    flat = [*(st.offset for st in steps), *(st.length for st in steps), *(st.start for st in steps),
            *tile_seq, *tile_q0]
    for st in steps:
        flat.extend(st.cache.block_table(width))
    ints = int_tensor(flat, device, "i")
    tiles = len(tile_seq)
    row0, qlen, start = ints[:3 * n].view(3, n).unbind()
    seq, q0 = ints[3 * n: 3 * n + 2 * tiles].view(2, tiles).unbind()
    return PagedBatch(ints[3 * n + 2 * tiles:].view(n, width), row0, qlen, start, seq, q0, block_q,
                      width * pool.block_size, key_splits(tiles, pool.num_kv_heads, width * pool.block_size, device))


@dataclass
class PassPlan:
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D], signed (see model.rope_tables)
    slots: torch.Tensor  # [T] where each token's K/V goes in the pool
    groups: list[AttentionGroup]
    pool: KVPool
    in_order: bool  # one group, no padding, rows 0..T-1: its output is the pass's as is
    decode_attention: DecodeAttention | None  # for the groups with a table
    ragged: PagedBatch | None = None  # every row attended in place by the ragged kernel (then groups is empty)
    ragged_attention: RaggedAttention | None = None


def plan_pass(steps: list[StepSlice], pool: KVPool, rope: tuple[torch.Tensor, torch.Tensor],
              device: torch.device, decode_attention: DecodeAttention | None = None,
              ragged_attention: RaggedAttention | None = None) -> PassPlan:
    cos, sin = rope
    if ragged_attention is not None:
        return _ragged_plan(steps, pool, cos, sin, device, ragged_attention)
    if decode_attention is not None and all(st.length == 1 for st in steps):
        return _paged_decode_plan(steps, pool, cos, sin, device, decode_attention)
    positions, slots = [], []
    for st in steps:
        positions.extend(range(st.start, st.start + st.length))
        slots.extend(pool.slots(st.cache, st.start, st.start + st.length))
    pos = int_tensor(positions, device)
    decode = [st for st in steps if st.length == 1]
    chunks = [st for st in steps if st.length > 1]
    paged = decode_attention is not None
    decode_groups = [decode] if paged else length_buckets(decode)
    groups = [_group(g, pool, device, paged) for g in decode_groups if g]
    if chunks:
        groups.append(_group(chunks, pool, device, False))
    in_order = len(groups) == 1 and groups[0].valid is None and (len(decode) == len(steps) or len(chunks) == 1)
    gathered = [g.size * g.k_len for g in groups if g.gather is not None]
    if gathered:
        pool.scratch(max(gathered))  # grown once here, before the layers use it
    return PassPlan(cos[pos, None], sin[pos, None], int_tensor(slots, device), groups, pool, in_order,
                    decode_attention)


def _ragged_plan(steps: list[StepSlice], pool: KVPool, cos: torch.Tensor, sin: torch.Tensor, device: torch.device,
                 ragged_attention: RaggedAttention) -> PassPlan:
    """plan_pass where the ragged kernel attends every row in place: positions, slots and the PagedBatch."""
    positions, slots = [], []
    for st in sorted(steps, key=lambda st: st.offset):
        positions.extend(range(st.start, st.start + st.length))
        slots.extend(pool.slots(st.cache, st.start, st.start + st.length))
    pos = int_tensor(positions, device)
    return PassPlan(cos[pos, None], sin[pos, None], int_tensor(slots, device), [], pool, True, None,
                    paged_batch(steps, pool, device), ragged_attention)


def _paged_decode_plan(steps: list[StepSlice], pool: KVPool, cos: torch.Tensor, sin: torch.Tensor,
                       device: torch.device, decode_attention: DecodeAttention) -> PassPlan:
    """plan_pass for a pass of decode steps only, attended by the paged kernel: one group in the pass's order.
    Its integers (positions, slots, rows, ends, block tables) go to the device as one tensor, viewed five ways:
    a tiny model's lone decode step spent ~11 us more on the general plan's separate tensors."""
    n = len(steps)
    k_len = max(st.start for st in steps) + 1
    width = pool.blocks_for(k_len)
    positions = [st.start for st in steps]
    flat = [*positions]
    for st in steps:
        flat.extend(pool.slots(st.cache, st.start, st.start + 1))
    flat.extend([*range(n), *(p + 1 for p in positions)])
    for st in steps:
        flat.extend(st.cache.block_table(width))
    ints = int_tensor(flat, device)
    pos, slot_t, rows, ends = ints[:4 * n].view(4, n).unbind()
    group = AttentionGroup(size=n, q_len=1, k_len=k_len, rows=rows, valid=None, gather=None,
                           table=ints[4 * n:].view(n, width), q_pos=pos.view(n, 1), ends=ends)
    return PassPlan(cos[pos, None], sin[pos, None], slot_t, [group], pool, True, decode_attention)


def length_buckets(decode: list[StepSlice], max_groups: int = MAX_DECODE_GROUPS,
                   padding: float = MAX_DECODE_PADDING) -> list[list[StepSlice]]:
    """Decode steps in groups of similar lengths, longest first: each group's keys are gathered padded to its
    own longest, and a group takes a shorter session only while its padded keys stay within `padding` times
    the keys it holds (the last of max_groups takes the rest). One group for the whole pass gathered ~2x the
    keys it attended over at the benchmark's mixed lengths (prompts 16-512, outputs 16-256)."""
    buckets: list[list[StepSlice]] = []
    held = longest = 0
    for st in sorted(decode, key=lambda st: st.start, reverse=True):
        end = st.start + 1
        if buckets and (len(buckets) == max_groups or (len(buckets[-1]) + 1) * longest <= padding * (held + end)):
            buckets[-1].append(st)
            held += end
        else:
            buckets.append([st])
            held = longest = end
    # Each group in the pass's order: a single group's output is then the pass's rows as they are (in_order).
    return [sorted(b, key=lambda st: st.offset) for b in buckets]


def _group(steps: list[StepSlice], pool: KVPool, device: torch.device, paged: bool) -> AttentionGroup:
    """paged: decode steps for the paged attention kernel (the block table); else an SDPA group (gather indices)."""
    bs = pool.block_size
    q_len = max(st.length for st in steps)
    ends = [st.start + st.length for st in steps]
    k_len = max(ends)
    rows, valid, q_pos = [], [], []
    for st in steps:
        pad = q_len - st.length
        rows.extend([*range(st.offset, st.offset + st.length), *([st.offset] * pad)])
        valid.extend([True] * st.length + [False] * pad)
        q_pos.extend([*range(st.start, st.start + st.length), *([0] * pad)])
    n_blocks = pool.blocks_for(k_len)
    table = int_tensor([b for st in steps for b in st.cache.block_table(n_blocks)], device).view(len(steps), n_blocks)
    ends_t = int_tensor(ends, device)
    gather = None
    if not paged:
        offsets = torch.arange(n_blocks * bs, device=device)
        slots = (table.repeat_interleave(bs, dim=1) * bs + offsets % bs)[:, :k_len]  # [B, Lk]
        inside = offsets[None, :k_len] < ends_t[:, None]
        gather = torch.where(inside, slots, offsets[None, :k_len] % bs + NULL_BLOCK * bs).reshape(-1)
    return AttentionGroup(
        size=len(steps), q_len=q_len, k_len=k_len,
        rows=int_tensor(rows, device),
        valid=None if all(valid) else int_tensor(valid, device, "B"),
        gather=gather, table=table if paged else None,
        q_pos=int_tensor(q_pos, device).view(len(steps), q_len),
        ends=ends_t,
    )
