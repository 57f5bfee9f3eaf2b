"""--cuda-graphs: on a CUDA device, a stage's decode passes replay CUDA graphs captured before SERVING.

A decode pass of a large model's slice is a few milliseconds of math on a GPU, and launching its hundreds of
kernels one by one from Python costs about as much (vLLM and SGLang capture their decode steps for this reason).
A CUDA graph launches them all at once, but it replays fixed shapes at fixed addresses, so the pass
(stage_server/decode_graph.py's, eager: the same function --compile hands to inductor) is captured once per
bucket: the batch padded up to a power of two (1, 2, 4 ... at most MAX_GRAPH_BATCH) and the block tables padded
up to a power of two of key blocks (2, 4 ... enough for the model's context). Each pass copies its token ids (or
hidden states), positions and block tables into the captured buffers and replays its bucket's graph.

Padding rows are inert: their position is 0 and their block table all NULL_BLOCK, so they write their K/V into
the null block that no session owns and attend only to it; padded key blocks lie past every real row's
position and are masked by selection (decode_graph.py says why selection, not -inf). So a row's result is the
one it would have in an eager decode pass of the same function.

A pass larger than the largest bucket, or any pass that is not all decode steps (prefill chunks), runs eager.
A capture that fails, or a stage not on CUDA, serves eager, logged once. The graphs share one memory pool and
are captured largest first, so they take about what the largest alone does; the capture's time and the count
show in the cold-start log line. Not with --compile, --quantize or --tp (config.py).

capture=False runs the same padded buffers through the function without a graph: what a machine without a GPU
can check of the padding (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from stage_server.decode_graph import decode_pass_fn, key_blocks
from stage_server.kv_pool import NULL_BLOCK, KVPool
from stage_server.model import StageModel, StepSlice

log = logging.getLogger("stagemesh.stage")

MAX_GRAPH_BATCH = 128
"""The largest decode pass replayed from a graph; a larger one (a pass of more sessions) runs eager."""


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low ... up to the first that reaches high."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest size >= n, or None when n is past them all."""
    return next((s for s in sizes if s >= n), None)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False, the function is called on the buffers
    out: torch.Tensor | None  # the graph's output buffer


class GraphedDecode:
    """model's decode passes replayed from CUDA graphs, one per (padded batch, padded key blocks) bucket;
    model.decode_graph holds it (StageModel.forward calls it for passes of decode steps only)."""

    def __init__(self, model: StageModel, pool: KVPool, max_batch: int, capture: bool = True):
        self.model, self.pool, self.capture = model, pool, capture
        self.fn = decode_pass_fn(model, pool.block_size)
        self.batches = powers_of_two(1, min(max_batch, MAX_GRAPH_BATCH))
        max_blocks = min(pool.blocks_for(model.args.max_position), pool.usable_blocks)
        self.widths = powers_of_two(2, max_blocks)
        self.cos, self.sin = model.rope(model.args.max_position, model.dtype)  # every position the model has
        top, device = self.batches[-1], model.device
        self.inputs = model.scratch_inputs(top)  # zeros: padding rows read finite inputs
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.tables = {nb: torch.full((top, nb), NULL_BLOCK, dtype=torch.long, device=device) for nb in self.widths}
        self.captured: dict[tuple[int, int], Captured] = {}
        self.graphs = 0  # graphs captured (compiled_graphs() reads it, as it reads --compile's)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every bucket, largest first (the later ones reuse the first's memory in the shared pool)."""
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for b in reversed(self.batches):
            for nb in reversed(self.widths):
                args = self._args(b, nb)
                if not self.capture:
                    self.captured[b, nb] = Captured(None, None)
                    continue
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # first use (cuBLAS handles, workspaces) outside the capture
                    self.fn(*args)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.fn(*args)
                self.captured[b, nb] = Captured(graph, out)
                self.graphs += 1

    def _args(self, b: int, nb: int) -> tuple:
        return (self.inputs[:b], self.pos[:b], self.tables[nb][:b], self.cos, self.sin, self.pool.k, self.pool.v)

    def __call__(self, inputs: torch.Tensor, steps: list[StepSlice]) -> torch.Tensor | None:
        """inputs: [B] token ids or [B, hidden]; steps: B decode steps at offsets 0..B-1. The pass's output,
        or None when it has no bucket (it runs eager)."""
        n = len(steps)
        b = bucket(n, self.batches)
        nb = bucket(key_blocks(steps), self.widths)
        if b is None or nb is None:
            return None
        # Rows past n: position 0 in the null block (what the buffers held at capture), whatever they held since.
        table = [st.cache.block_table(nb) for st in steps]
        table += [[NULL_BLOCK] * nb] * (b - n)
        pos = [st.start for st in steps] + [0] * (b - n)
        self.inputs[:n].copy_(inputs)
        self.pos[:b].copy_(torch.tensor(pos))
        self.tables[nb][:b].copy_(torch.tensor(table))
        captured = self.captured[b, nb]
        if captured.graph is None:
            out = self.fn(*self._args(b, nb))
        else:
            captured.graph.replay()
            out = captured.out
        return out[:n].clone()  # the next replay overwrites the graph's output buffer


def capture_decode_graphs(model: StageModel, pool: KVPool, max_batch: int) -> str:
    """Captures model's decode graphs over pool and serves its decode passes from them; where it cannot (not
    on CUDA, or the capture failed) the stage stays eager. Returns what the cold-start log line says of it."""
    model.decode_graph = None  # graphs of an earlier pool, if the slice is activated again
    if model.device.type != "cuda":
        log.warning(f"--cuda-graphs: the stage is on {model.device.type}, not CUDA; serving eager")
        return " (--cuda-graphs: eager, not on CUDA)"
    graphed = GraphedDecode(model, pool, max_batch)
    try:
        graphed.capture_all()
    except Exception as exc:  # the capture's failure, whatever its kind: eager is always right
        first_line = (str(exc).strip().splitlines() or [""])[0]
        log.warning(f"--cuda-graphs: capture failed ({type(exc).__name__}: {first_line}); serving eager")
        torch.cuda.synchronize()
        return " (--cuda-graphs: eager, the capture failed)"
    model.decode_graph = graphed
    return f" with {graphed.graphs} CUDA graphs (batches {graphed.batches[-1]} and under, " \
           f"up to {graphed.widths[-1]} key blocks)"
