"""A stage's warm-up before it says SERVING: first-use costs paid by scratch passes, not by the first caller, CUDA
graphs captured, and two passes timed so that a fresh chain's first long pass is not taken for a hang."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stagemesh.stage_server.engine.compiled import is_compiled, warm_up_decode
from stagemesh.stage_server.engine.kv_pool import KVPool, PoolExhausted
from stagemesh.stage_server.engine.model import StageModel, StepSlice
from stagemesh.stage_server.gpu.cuda_graphs import capture_pass_graphs


def _scratch_passes(model: StageModel, pool: KVPool, lengths: tuple[int, ...]) -> list[float]:
    """Passes of these token counts, one after another, over a scratch session; the seconds of each."""
    cache = pool.allocate(sum(lengths))
    seconds = []
    try:
        start = 0
        for n in lengths:
            pool.grow(cache, start + n)
            t0 = time.perf_counter()
            model(model.scratch_inputs(n), [StepSlice(cache, 0, start, n)])
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)  # the pass itself, not its launch (a graph's replay returns)
            seconds.append(time.perf_counter() - t0)
            start += n
    finally:
        pool.release(cache)
    return seconds


PROBE_TOKENS = 128
"""The warm-up times a prefill pass of this many tokens (at most --max-batch-tokens) and scales it to a full
pass: what the stage reports as the longest pass a step may wait behind before it has run one (StageInfo.pass_ms)."""


@dataclass
class WarmUp:
    seconds: float
    step_ms: float
    """Its timed decode pass: one token, after a PROBE_TOKENS prompt."""
    full_pass_ms: float
    """Its timed prefill pass scaled to max_batch_tokens tokens. Per token a short pass costs more than a full
    one (the weights are read once a pass), so the estimate errs long; 0 where the pool could not hold it."""
    graphs: str = ""
    """What CUDA graphs were captured, for the cold-start log line ("" on a CPU)."""


def warm_up(model: StageModel, pool: KVPool, max_batch_tokens: int, graphs: bool = False,
            max_len: int | None = None) -> WarmUp:
    """Passes over a scratch session before the stage says SERVING, so that the first caller does not pay for
    first-use costs (allocator growth, kernel selection, --compile's compilation of its decode graphs), and
    two of them timed, so that a fresh chain's first long pass is not taken for a hang (a router times a step
    by the passes its stages report, and before this they had none). A compilation that fails leaves the stage
    eager (logged once). With graphs, on CUDA, every pass's graphs are captured first, for sessions of up to max_len
    positions (the timed passes replay them)."""
    t0 = time.perf_counter()
    if is_compiled(model):
        warm_up_decode(model, pool)
    captured = ""
    if graphs and model.device.type == "cuda":
        captured = capture_pass_graphs(model, pool, max_batch_tokens, max_len or model.args.max_position)
    _scratch_passes(model, pool, (1,))
    n = max(1, min(PROBE_TOKENS, max_batch_tokens, model.args.max_position - 1))
    try:
        prefill_s, step_s = _scratch_passes(model, pool, (n, 1))
    except PoolExhausted:
        prefill_s = step_s = 0.0
    return WarmUp(time.perf_counter() - t0, step_s * 1000, prefill_s * 1000 * max_batch_tokens / n, captured)
