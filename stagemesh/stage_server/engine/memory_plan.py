"""How much of a device the KV pool and the repair log may take: on a GPU, what is left of --gpu-memory-utilization's
share once the weights, a full pass's activations (measured by one profiling pass) and the CUDA graphs' memory are
counted, as vLLM sizes its cache; on a CPU, a quarter of the memory available at start.

The pool is allocated once and never grows, so its size is the stage's capacity: how many sessions, how long.
Sized after everything else, it takes what would otherwise sit unused, and graphs captured after it find the room
they were counted.

A stage with a next stage also keeps a repair log (service/output_log.py: the hidden states it sent on, a row per
position). By default the room is split so that the pool and the log hold the same number of positions (every
position the pool can hold can be logged), both on the device. A --repair-log-tokens of at most that many is
taken from the room too; more than that does not fit beside the pool on the device and is kept in pinned host
memory, the pool taking the whole room. With --kv-cache-gb the pool is what it says, and the log goes on the device
only if the room left beside the pool holds it."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.pass_plan import StepSlice


class NoRoomForPool(ValueError):
    """The weights and a pass's activations leave the KV pool nothing: a configuration error, said at start."""


def gpu_pool_bytes(total: int, in_use: int, activation_peak: int, utilization: float, graphs: bool) -> int:
    """The KV pool's bytes on a GPU of `total` bytes: utilization of it, less what is in use (weights), the
    activations of the largest pass, and as much again for the graphs' memory pool when graphs are captured (they
    share one pool, captured largest first: about what the largest pass alone takes)."""
    left = int(total * utilization) - in_use - activation_peak * (2 if graphs else 1)
    if left <= 0:
        raise NoRoomForPool(
            f"no room for a KV pool: {utilization:.0%} of the GPU's {total / 2**30:.1f} GiB is "
            f"{total * utilization / 2**30:.1f} GiB, the weights hold {in_use / 2**30:.1f} GiB and a full pass's "
            f"activations take {activation_peak / 2**30:.2f} GiB{' (twice: eager and graphs)' if graphs else ''}; "
            "give the stage fewer layers, a smaller --max-batch-tokens, or a larger --gpu-memory-utilization")
    return left


def profile_pass(model: StageModel, tokens: int) -> int:
    """The activation memory of one pass of `tokens` tokens on CUDA (peak allocated above what was allocated
    before), run over a scratch pool just large enough, which is freed after."""
    device = model.device
    a = model.args
    bs = 16
    blocks = -(-tokens // bs) + 2
    block_bytes = 2 * len(model.layers) * a.num_kv_heads * bs * a.head_dim * model.dtype.itemsize
    pool = KVPool(blocks * block_bytes, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, device,
                  block_size=bs, lookahead_blocks=0)
    cache = pool.allocate(tokens)
    pool.grow(cache, tokens)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        model(model.scratch_inputs(tokens), [StepSlice(cache, 0, 0, tokens)])
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    finally:
        pool.release(cache)
        del pool
        torch.cuda.empty_cache()


def kv_pool_bytes(model: StageModel, kv_cache_gb: float | None, pass_tokens: int, utilization: float,
                  graphs: bool) -> int:
    """--kv-cache-gb, or on CUDA gpu_pool_bytes after a profiling pass, or a quarter of the host's available
    memory."""
    if kv_cache_gb:
        return int(kv_cache_gb * 2**30)
    if model.device.type == "cuda":
        peak = profile_pass(model, min(pass_tokens, model.args.max_position))
        _, total = torch.cuda.mem_get_info(model.device)
        return gpu_pool_bytes(total, torch.cuda.memory_allocated(model.device), peak, utilization, graphs)
    return psutil.virtual_memory().available // 4


@dataclass
class MemoryPlan:
    kv_bytes: int
    """The KV pool's bytes."""
    log_tokens: int
    """The repair log's positions (0: none: a last stage, or --repair-log-tokens 0)."""
    log_device: torch.device
    """Where the log lies: the stage's device, or the host (pinned where CUDA is available)."""


def token_bytes(model: StageModel) -> tuple[int, int]:
    """(KV pool bytes, repair log bytes) of one position on this stage; no log on a last stage (nothing goes on)."""
    a, itemsize = model.args, model.dtype.itemsize
    log_token = 0 if model.is_last else a.hidden_size * itemsize
    return 2 * len(model.layers) * a.num_kv_heads * a.head_dim * itemsize, log_token


def split_room(room: int, kv_token: int, log_token: int, log_tokens: int | None) -> tuple[int, int, bool]:
    """(pool bytes, log tokens, log beside the pool) for `room` bytes shared by the pool and the log: by default
    as many positions each; a log of more positions than that does not fit beside the pool (kept elsewhere)."""
    even = room // (kv_token + log_token) if log_token else 0
    tokens = even if log_tokens is None else log_tokens
    if tokens * log_token and tokens <= even:
        return room - tokens * log_token, tokens, True
    return room, tokens if log_token else 0, False


def plan_memory(model: StageModel, kv_cache_gb: float | None, pass_tokens: int, utilization: float, graphs: bool,
                log_tokens: int | None) -> MemoryPlan:
    """The KV pool's bytes and the repair log's size and place (the module's docstring says how)."""
    kv_token, log_token = token_bytes(model)
    host = torch.device("cpu")
    if not kv_cache_gb:
        pool, tokens, beside = split_room(kv_pool_bytes(model, None, pass_tokens, utilization, graphs), kv_token,
                                          log_token, log_tokens)
        return MemoryPlan(pool, tokens, model.device if beside else host)
    pool = int(kv_cache_gb * 2**30)
    tokens = (pool // kv_token if log_tokens is None else log_tokens) if log_token else 0
    if model.device.type != "cuda" or not tokens:
        return MemoryPlan(pool, tokens, host)
    try:
        room = kv_pool_bytes(model, None, pass_tokens, utilization, graphs) - pool
    except NoRoomForPool:
        room = 0
    return MemoryPlan(pool, tokens, model.device if tokens * log_token <= room else host)
