"""CUDA graphs for every pass shape: a stage's passes replay graphs captured in the warm-up, before SERVING.

A pass of a large model's slice is a few milliseconds of math on a GPU, and launching its hundreds of kernels one
by one from Python costs about as much (vLLM and SGLang capture their passes for this reason). A graph replays
fixed shapes at fixed addresses, so passes are captured by bucket, each with buffers of its own:

- decode passes (every step one token) by their session count padded up to a power of two (1, 2, 4 ... 128);
- prefill chunks and passes that mix chunks with decode steps by their token count padded up to a power of two
  (16, 32 ... the pass budget), with room for as many sessions as tokens (up to 128).

What makes this possible is the ragged attention kernel (triton_attention.py): every row finds its session, its
position and its keys through small integer tensors (the pass's PagedBatch), so a pass's whole shape lives in
tensors of fixed size whose contents change from pass to pass; block tables are as wide as --max-model-len
allows (the kernel reads no entry past a session's length). A pass fills its bucket's host buffer (pinned on
CUDA), copies it to the device in one transfer, copies its inputs, and replays.

Padding is inert: padding rows sit at position 0 and write their K/V into the pool's null block, which no
session owns and the ragged kernel never reads; padding sessions have no queries, and padding tiles point at one
of them, so they store nothing. A row's result is the one the same function gives it eagerly.

A pass that fits no bucket runs eager, counted by reason (stagemesh_stage_eager_passes_total); a capture that
fails is logged with its reason and counted, and the stage serves eager. capture=False runs the same padded
buffers through the same function without a graph: what a machine without a GPU checks (through Triton's
interpreter, tests/triton_interpreted.py).
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field

import torch

from stagemesh import metrics
from stagemesh.stage_server.engine.kv_pool import NULL_BLOCK, KVPool
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.pass_plan import PagedBatch, PassPlan, StepSlice, key_splits

log = logging.getLogger("stagemesh.stage")

MAX_GRAPH_SESSIONS = 128
"""The most sessions a graphed pass holds; a pass of more runs eager."""
MIN_MIXED_TOKENS = 16
"""The smallest bucket of passes that are not all decode steps."""
MIXED_BLOCK_Q = 16
"""Queries per tile of a mixed bucket (a decode bucket's tiles hold one)."""


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low ... up to the first that reaches high."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest size >= n, or None when n is past them all."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class Shape:
    """A bucket: `tokens` rows, room for `sessions` sessions (one more is the padding session) and `tiles`
    tiles of `block_q` queries."""

    decode: bool
    tokens: int
    sessions: int
    tiles: int
    block_q: int


@dataclass
class Bucket:
    shape: Shape
    longs: torch.Tensor  # on the device: positions [T], slots [T], each session's last row [S]
    ints: torch.Tensor  # on the device: row0, q_len, start [S + 1], tile session, tile q0 [n], tables [S + 1, nb]
    host_longs: torch.Tensor  # their host copies (pinned on CUDA), filled by each pass
    host_ints: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None  # None: capture=False, run() is called on the buffers
    copied: torch.cuda.Event | None = None  # on CUDA, recorded after the host buffers' last copy to the device
    out: torch.Tensor | None = None  # the graph's output
    capture_s: float = 0.0
    capture_bytes: int = 0


@dataclass
class Captures:
    """What the warm-up captured, for its log line and StageInfo."""

    graphs: int = 0
    failed: str = ""
    seconds: float = 0.0
    bytes: int = 0
    buckets: list[str] = field(default_factory=list)


class GraphedPasses:
    """model's passes replayed from CUDA graphs, one per bucket (see the module's docstring); model.pass_graphs
    holds it, and StageModel.forward hands it every pass first (None back: the pass runs eager)."""

    def __init__(self, model: StageModel, pool: KVPool, max_tokens: int, max_len: int, capture: bool = True,
                 max_sessions: int = MAX_GRAPH_SESSIONS):
        if model.ragged_attention is None:
            raise ValueError("graphs of every pass need the ragged attention kernel (Triton, on CUDA)")
        self.model, self.pool, self.capture = model, pool, capture
        self.width = pool.blocks_for(max_len)  # every table's width: --max-model-len's blocks
        self.max_len = self.width * pool.block_size
        self.cos, self.sin = model.rope(self.max_len, model.dtype)
        device = model.device
        decode_top = min(max_sessions, max_tokens)
        self.shapes = [Shape(True, b, b, b, 1) for b in powers_of_two(1, decode_top)]
        if max_tokens >= MIN_MIXED_TOKENS:
            self.shapes += [Shape(False, t, min(t, max_sessions), min(t, max_sessions) + t // MIXED_BLOCK_Q,
                                  MIXED_BLOCK_Q) for t in powers_of_two(MIN_MIXED_TOKENS, max_tokens)]
        self.decode_sizes = [s.tokens for s in self.shapes if s.decode]
        self.mixed_sizes = [s.tokens for s in self.shapes if not s.decode]
        top = max(s.tokens for s in self.shapes)
        self.inputs = model.scratch_inputs(top)  # real rows copied in by each pass; padding rows stay finite
        pin = device.type == "cuda"
        self.buckets: dict[tuple[bool, int], Bucket] = {}
        for shape in self.shapes:
            n_longs = 2 * shape.tokens + shape.sessions
            n_ints = 3 * (shape.sessions + 1) + 2 * shape.tiles + (shape.sessions + 1) * self.width
            self.buckets[shape.decode, shape.tokens] = Bucket(
                shape, torch.zeros(n_longs, dtype=torch.long, device=device),
                torch.zeros(n_ints, dtype=torch.int32, device=device),
                torch.zeros(n_longs, dtype=torch.long, pin_memory=pin), torch.zeros(n_ints, dtype=torch.int32,
                                                                                    pin_memory=pin))
        self.captures = Captures()

    def _views(self, b: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch]:
        """A bucket's positions, slots, last rows and PagedBatch: views of its device buffers."""
        s = b.shape
        pos, slots, last = b.longs.split([s.tokens, s.tokens, s.sessions])
        n = s.sessions + 1
        row0, qlen, start, seq, q0, tables = b.ints.split([n, n, n, s.tiles, s.tiles, n * self.width])
        splits = key_splits(s.tiles, self.pool.num_kv_heads, self.max_len, self.model.device)
        batch = PagedBatch(tables.view(n, self.width), row0, qlen, start, seq, q0, s.block_q, self.max_len, splits)
        return pos, slots, last, batch

    def run(self, b: Bucket) -> torch.Tensor:
        """The bucket's pass over its buffers: what a graph captures (and capture=False calls)."""
        model, s = self.model, b.shape
        pos, slots, last, batch = self._views(b)
        inputs = self.inputs[:s.tokens]
        x = model.embed_tokens(inputs) if model.is_first else inputs.to(model.dtype)
        plan = PassPlan(self.cos[pos][:, None], self.sin[pos][:, None], slots, [], self.pool, True, None, batch,
                        model.ragged_attention)
        x = model.run_layers(x, plan)
        if not model.is_last:
            return x
        return model.lm_head(model.norm(x if s.decode else x[last])).float()

    def _fill(self, b: Bucket, steps: list[StepSlice]) -> None:
        """The pass's integers into the bucket's host buffers and on to the device. Of the block tables only the
        pass's sessions' rows are written, and of those only the columns that hold blocks: the kernel reads no
        entry past a session's length and no row of a padding session (no queries), so what earlier passes left
        there is never read. Written whole, the tables were (sessions + 1) x --max-model-len's blocks of Python
        ints every pass: ~6 ms a 64-session pass at a 4,096-position context, ~50 ms at 131,072 (on a 2-vCPU VM)."""
        s, bs, pad = b.shape, self.pool.block_size, b.shape.sessions
        if b.copied is not None:
            b.copied.synchronize()  # the last pass's copy out of the host buffers is done before they change
        positions, slot_list, last, tile_seq, tile_q0 = [], [], [], [], []
        for i, st in enumerate(steps):
            positions.extend(range(st.start, st.start + st.length))
            slot_list.extend(self.pool.slots(st.cache, st.start, st.start + st.length))
            last.append(st.offset + st.length - 1)
            for q0 in range(0, st.length, s.block_q):
                tile_seq.append(i)
                tile_q0.append(q0)
        rows = len(positions)
        positions += [0] * (s.tokens - rows)
        slot_list += [NULL_BLOCK * bs] * (s.tokens - rows)  # padding rows write into the null block
        last += [0] * (s.sessions - len(steps))
        sessions = len(steps)
        row0 = [st.offset for st in steps] + [0] * (pad + 1 - sessions)
        qlen = [st.length for st in steps] + [0] * (pad + 1 - sessions)  # padding sessions: no queries
        start = [st.start for st in steps] + [0] * (pad + 1 - sessions)
        tile_seq += [pad] * (s.tiles - len(tile_seq))  # padding tiles: the padding session's
        tile_q0 += [0] * (s.tiles - len(tile_q0))
        head = array("i", row0 + qlen + start + tile_seq + tile_q0)
        width = min(self.width, max((len(st.cache.blocks) for st in steps), default=0))
        tables = array("i")
        for st in steps:
            tables.extend(st.cache.block_table(width))
        b.host_longs.copy_(torch.frombuffer(array("q", positions + slot_list + last), dtype=torch.long))
        b.host_ints[:len(head)].copy_(torch.frombuffer(head, dtype=torch.int32))
        if width:
            b.host_ints[len(head):].view(pad + 1, self.width)[:sessions, :width].copy_(
                torch.frombuffer(tables, dtype=torch.int32).view(sessions, width))
        used = len(head) + sessions * self.width  # up to the last row read
        b.longs.copy_(b.host_longs, non_blocking=True)
        b.ints[:used].copy_(b.host_ints[:used], non_blocking=True)
        if b.ints.is_cuda:
            if b.copied is None:
                b.copied = torch.cuda.Event()
            b.copied.record()

    def fill_padding(self, b: Bucket) -> None:
        """The bucket's buffers as a pass of padding alone, inert (its rows write into the null block): what a
        capture runs, once outside the graph and once inside."""
        self._fill(b, [])

    def pick(self, inputs: torch.Tensor, steps: list[StepSlice]) -> tuple[Bucket | None, str]:
        """The bucket of this pass, or None and why it has none."""
        tokens, sessions = inputs.shape[0], len(steps)
        if max(st.start + st.length for st in steps) > self.max_len:
            return None, "past_max_len"
        if tokens == sessions:  # decode steps only
            size = bucket(sessions, self.decode_sizes)
            return (self.buckets[True, size], "") if size is not None else (None, "too_many_sessions")
        size = bucket(tokens, self.mixed_sizes)
        if size is None:
            return None, "too_many_tokens"
        b = self.buckets[False, size]
        if sessions > b.shape.sessions:
            return None, "too_many_sessions"
        return b, ""

    def __call__(self, inputs: torch.Tensor, steps: list[StepSlice]) -> torch.Tensor | None:
        """inputs: [T] token ids or [T, hidden]; steps in the pass's row order. The pass's output (hidden states
        [T, hidden], or on the last stage each step's logits [len(steps), vocab] in float32), or None when it has
        no bucket or its bucket no graph (it runs eager)."""
        b, why = self.pick(inputs, steps)
        if b is None or (self.capture and b.graph is None):
            metrics.EAGER_PASSES.labels(why or "not_captured").inc()
            return None
        self._fill(b, steps)
        self.inputs[:inputs.shape[0]].copy_(inputs, non_blocking=True)
        if b.graph is None:
            out = self.run(b)
        else:
            b.graph.replay()
            out = b.out
        rows = len(steps) if self.model.is_last else inputs.shape[0]
        return out[:rows].clone()  # the next replay overwrites the graph's output buffer

    @torch.inference_mode()
    def capture_all(self) -> Captures:
        """Captures every bucket, largest first (the later ones reuse the first's memory in the shared pool).
        A failure stops the captures: the buckets captured so far stay, the rest run eager."""
        cap = self.captures
        if not self.capture:
            return cap
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets.values(), key=lambda b: (b.shape.tokens, not b.shape.decode), reverse=True):
            t0, before = time.perf_counter(), torch.cuda.memory_reserved()
            try:
                self.fill_padding(b)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # first use (cuBLAS handles, Triton's compilation) outside the graph
                    self.run(b)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    b.out = self.run(b)
                b.graph = graph
            except Exception as exc:  # whatever its kind: eager is always right
                first_line = (str(exc).strip().splitlines() or [""])[0]
                cap.failed = f"{type(exc).__name__}: {first_line}"
                metrics.GRAPH_CAPTURE_FAILURES.inc()
                log.warning(f"CUDA graph capture of the {'decode' if b.shape.decode else 'mixed'} bucket of "
                            f"{b.shape.tokens} tokens failed ({cap.failed}); the buckets not captured run eager")
                torch.cuda.synchronize()
                break
            b.capture_s = time.perf_counter() - t0
            b.capture_bytes = torch.cuda.memory_reserved() - before
            cap.graphs += 1
            cap.seconds += b.capture_s
            cap.bytes += b.capture_bytes
            cap.buckets.append(f"{'decode' if b.shape.decode else 'mixed'}:{b.shape.tokens} "
                               f"{b.capture_s * 1000:.0f} ms {b.capture_bytes / 2**20:.0f} MiB")
        return cap


def capture_pass_graphs(model: StageModel, pool: KVPool, max_tokens: int, max_len: int) -> str:
    """Captures model's pass graphs over pool and serves its passes from them; where it cannot (not on CUDA, no
    ragged kernel) the stage stays eager. Returns what the cold-start log line says of it."""
    model.pass_graphs = None  # graphs of an earlier pool, if the slice is activated again
    if model.device.type != "cuda":
        return " (eager: CUDA graphs are for CUDA stages)"
    if model.ragged_attention is None:
        log.warning("CUDA graphs need the ragged attention kernel (Triton), which did not load; serving eager")
        return " (eager: no Triton attention kernel for CUDA graphs)"
    graphed = GraphedPasses(model, pool, max_tokens, max_len)
    cap = graphed.capture_all()
    if cap.graphs:
        model.pass_graphs = graphed
    log.info("CUDA graphs captured (bucket, time, memory): " + "; ".join(cap.buckets))
    failed = f", then the capture failed: {cap.failed}" if cap.failed else ""
    return (f" with {cap.graphs} CUDA graphs in {cap.seconds:.1f}s, {cap.bytes / 2**20:.0f} MiB (decode passes of "
            f"up to {graphed.decode_sizes[-1]} sessions, mixed passes of up to "
            f"{graphed.mixed_sizes[-1] if graphed.mixed_sizes else 0} tokens{failed})")
