"""--compile: a stage's decode passes run as one torch.compile'd (inductor) graph, with a fallback to eager.

A pass whose every row is one session's one new token (the batcher's decode passes) goes through the whole
decode pass of stage_server/engine/decode_graph.py, compiled once per stage: all layers, K/V writes into the paged
pool, masks and gathers, the LM head. Anything else (prefill chunks, passes that mix them with decode steps)
runs eager, as without the flag. Per-module compilation (each MLP, norm and the LM head apart) was measured
slower than eager on this CPU (docs/performance.md) and is gone.

Shapes: the batch size B and the block-table width nb (key blocks) are dynamic, so a stage compiles two graphs
(B = 1, which dynamo specialises, and B >= 2) rather than one per size; nb is at least 2 for the same reason.
The stage's warm-up (warm_up_decode, before SERVING) compiles both, and the cold-start log line counts the
time. Guards: tensor guards only (torch.compiler.keep_tensor_guards_unsafe: dynamo's other guards were ~30%
of a compiled call), safe because a stage's model and pool never change under their graph; each stage's
compile keeps its own graphs (isolate_recompiles), so two stages in one process never share one.

Compilation that fails (in the warm-up or on a later shape) sends the stage back to eager for good, logged
once; the pass that failed runs eager. --tp is refused with --compile (the ranks' all-reduces are not in
the graph), and so is --quantize (config.py). A CUDA stage's own graphs (stage_server/gpu/cuda_graphs.py: every pass
captured per padded bucket) are not captured beside --compile.
"""

from __future__ import annotations

import logging

import torch
import torch.compiler

from stagemesh.stage_server.engine.decode_graph import decode_pass_fn, key_blocks
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.model import StageModel, StepSlice
from stagemesh.stage_server.engine.pass_plan import int_tensor

log = logging.getLogger("stagemesh.stage")


class CompiledDecode:
    """model's decode passes through one compiled graph (per shape class); model.decode_graph holds it."""

    def __init__(self, model: StageModel):
        self.model = model
        self.graphs = 0  # graphs inductor has compiled for this stage (a recompile adds one)
        self._fn = None
        self._block_size = 0
        self._rope_marked: torch.Tensor | None = None

    def _compiler(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        # Imported here, not at the top: inductor (with dynamo) is ~2.5 s of a stage's start, paid only with --compile.
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)

    def _compiled(self, block_size: int):
        if self._fn is None or block_size != self._block_size:
            self._fn = torch.compile(decode_pass_fn(self.model, block_size), backend=self._compiler, dynamic=True,
                                     fullgraph=True, isolate_recompiles=True,
                                     options={"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe})
            self._block_size = block_size
        return self._fn

    def __call__(self, inputs: torch.Tensor, steps: list[StepSlice]) -> torch.Tensor | None:
        """inputs: [B] token ids or [B, hidden]; steps: B decode steps at offsets 0..B-1. Returns what
        StageModel.forward returns (it sets the caches' lengths), or None when compilation failed: the stage
        is eager from now on, and the pass runs eager (it rewrites whatever K/V this one wrote)."""
        try:
            return self._run(inputs, steps)
        except Exception as exc:  # the compiler's failure, whatever its kind
            uncompile_stage(self.model, exc)
            return None

    def _run(self, inputs: torch.Tensor, steps: list[StepSlice]) -> torch.Tensor:
        pool = steps[0].cache.pool
        end = max(st.start for st in steps) + 1
        nb = key_blocks(steps)
        table = int_tensor([b for st in steps for b in st.cache.block_table(nb)], inputs.device).view(len(steps), nb)
        pos = int_tensor([st.start for st in steps], inputs.device)  # [B]
        cos, sin = self.model.rope(end, self.model.dtype)
        if self._rope_marked is not cos:  # the pool and the rope tables are static: their sizes never vary
            for t in (cos, sin, pool.k, pool.v):
                torch._dynamo.mark_static(t)
            self._rope_marked = cos
        return self._compiled(pool.block_size)(inputs, pos, table, cos, sin, pool.k, pool.v)


def compile_stage(model: StageModel) -> None:
    """From now on model's decode passes go through a compiled graph (compiled on first use: warm_up_decode)."""
    model.decode_graph = CompiledDecode(model)


def uncompile_stage(model: StageModel, reason: BaseException) -> None:
    """Back to eager for good, logged once."""
    model.decode_graph = None
    first_line = (str(reason).strip().splitlines() or [""])[0]
    log.warning(f"--compile: compilation failed ({type(reason).__name__}: {first_line}); serving eager")


def is_compiled(model: StageModel) -> bool:
    return isinstance(model.decode_graph, CompiledDecode)


def compiled_graphs(model: StageModel) -> int:
    """Graphs compiled so far for model's decode passes (0 when eager)."""
    return model.decode_graph.graphs if model.decode_graph is not None else 0


def warm_up_decode(model: StageModel, pool: KVPool) -> None:
    """Compiles the decode graphs the stage will use, before SERVING: a pass of one session (B = 1) and one of
    two (B >= 2), over scratch sessions of 2 and 3 blocks (B and nb unequal: dynamo would tie equal sizes)."""
    bs = pool.block_size
    caches = [pool.allocate(3 * bs + 2) for _ in range(2)]
    try:
        for cache, n in zip(caches, (bs + 1, 2 * bs + 1), strict=True):
            pool.grow(cache, n)
            model(model.scratch_inputs(n), [StepSlice(cache, 0, 0, n)])  # eager prefill
        # specialize_float: the graph's float constants stay constants (else dynamo traces each graph twice).
        with torch._dynamo.config.patch(specialize_float=True):
            for batch in (caches[:1], caches):
                steps = []
                for i, cache in enumerate(batch):
                    pool.grow(cache, cache.length + 1)
                    steps.append(StepSlice(cache, i, cache.length, 1))
                model(model.scratch_inputs(len(steps)), steps)
    finally:
        for cache in caches:
            pool.release(cache)
