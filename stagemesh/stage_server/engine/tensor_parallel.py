"""A tensor-parallel stage (`--tp K`): the stage's slice on K ranks of this host, one process per rank.

Megatron's split of a decoder layer: each rank holds H/K attention heads and kvH/K KV heads (so its KV
pool holds its own heads only) and I/K MLP columns. The fused q/k/v and gate/up projections are
column-parallel (each of q, k, v and gate, up sharded apart, then fused as usual); o_proj and down_proj
are row-parallel: each rank's partial product is summed over the ranks by ONE all-reduce per
projection, and their bias is added once, after it. Embeddings, norms and the LM head are replicated:
every rank embeds the token ids itself (a broadcast of T ids is cheaper than of [T, hidden]), and only
rank 0 runs the final norm and LM head — a vocabulary split would add a gather of the logits per step,
which on one host's shared cores or memory bandwidth saves little of the LM head's time; see docs/decisions.md.

Rank 0 is the stage server: it owns the gRPC endpoint, sessions, KV admission and the batcher. Its
model carries a forward pre-hook that, before every pass, broadcasts what the pass needs (the token ids
or hidden states, and each step's offset, start, length and block table, and the pool's size); the
other ranks (stage_server/engine/tp_worker.py) run the same forward on their shards and their own pools.

Failure: a rank that dies takes the stage down as one. Rank 0 watches its ranks' processes and, when
one exits, kills the others and exits itself (its registration lapses; routers fail over); a rank whose
rank 0 dies exits (it watches its parent, and its collectives fail when rank 0's sockets close). So does
a pass that fails on rank 0 after its broadcast (the other ranks wait in its collectives): the next pass
finds the ranks out of step and stops the stage, instead of hanging.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from stagemesh.checkpoint import ModelArgs
from stagemesh.stage_server.engine.kv_pool import KVPool, SessionCache
from stagemesh.stage_server.engine.pass_plan import StepSlice

log = logging.getLogger("stagemesh.stage")
OP_PASS, HEADER = 1, 8  # header: [op, tokens, steps, hidden inputs?, pool blocks, block size, meta length, 0]
GROUP_TIMEOUT = datetime.timedelta(days=1)
"""Collectives wait this long: an idle stage's ranks wait for the next pass. Death is found by watching
processes instead (a dead peer's closed sockets also fail the collectives at once)."""
WATCH_S = 0.1


def check_tp(args: ModelArgs, size: int, device: torch.device | None = None) -> None:
    """Raises ValueError saying why the model cannot be split over `size` ranks (on device's host)."""
    if size == 1:
        return
    if device is not None and device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"--tp {size} needs {size} CUDA devices from {device} on; torch sees "
                         f"{torch.cuda.device_count()}")
    if args.num_heads % size or args.num_kv_heads % size:
        raise ValueError(f"--tp {size} must divide the model's attention heads ({args.num_heads}) and its KV "
                         f"heads ({args.num_kv_heads}); use a --tp that divides both")
    if args.intermediate_size % size:
        raise ValueError(f"--tp {size} must divide the model's MLP width (intermediate_size "
                         f"{args.intermediate_size}); use a --tp that divides it")


def rank_args(args: ModelArgs, size: int) -> ModelArgs:
    """The model as one of `size` ranks sees it: its share of the heads and MLP columns."""
    if size == 1:
        return args
    check_tp(args, size)
    return dataclasses.replace(args, num_heads=args.num_heads // size, num_kv_heads=args.num_kv_heads // size,
                               intermediate_size=args.intermediate_size // size)


def shard_of(ours: str, part: int, args: ModelArgs, rank: int, size: int) -> tuple[slice, slice] | None:
    """Rows and columns of checkpoint tensor number `part` of our parameter `ours` that rank holds (None:
    all of it). args: the whole model's."""
    if size == 1:
        return None
    every = slice(None)
    if ".qkv_proj." in ours:  # q, k, v parts: rows of this rank's heads
        heads = args.num_heads if part == 0 else args.num_kv_heads
        n = heads // size * args.head_dim
        return slice(rank * n, (rank + 1) * n), every
    n = args.intermediate_size // size
    if ".gate_up_proj." in ours:  # gate, up parts: rows of this rank's columns
        return slice(rank * n, (rank + 1) * n), every
    if ours.endswith("down_proj.weight"):  # row-parallel: the input columns of this rank's MLP columns
        return every, slice(rank * n, (rank + 1) * n)
    if ours.endswith("o_proj.weight"):  # row-parallel: the input columns of this rank's heads
        n = args.num_heads // size * args.head_dim
        return every, slice(rank * n, (rank + 1) * n)
    return None  # norms, embeddings, the LM head, o_proj/down_proj biases: replicated


class RowParallel(nn.Module):
    """A row-parallel Linear: this rank's partial product, summed over the ranks, then the bias once."""

    def __init__(self, linear: nn.Linear, reduce: Callable[[torch.Tensor], None]):
        super().__init__()
        self.bias = linear.bias
        linear.bias = None
        self.linear = linear
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [T, hidden], this rank's part of the sum
        self.reduce(y)
        return y if self.bias is None else y + self.bias


def _reducer(group) -> Callable[[torch.Tensor], None]:
    def reduce(t: torch.Tensor) -> None:
        group.allreduce([t]).wait()  # in place: the sum over the ranks

    return reduce


def shard_layers(model: nn.Module, group) -> None:
    """o_proj and down_proj of every layer become row-parallel over group."""
    reduce = _reducer(group)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, reduce)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, reduce)


def new_group(backend: str, port: int, rank: int, size: int):
    """Joins the ranks' group over the TCP store rank 0 serves on 127.0.0.1:port (blocks until all join)."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=GROUP_TIMEOUT)
    return _group(backend, store, rank, size)


def _group(backend: str, store, rank: int, size: int):
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a CUDA stage runs on the r-th device after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


# The pass, on the wire between ranks.

def send_pass(group, inputs: torch.Tensor, steps: list[StepSlice], wire: torch.device) -> None:
    """Rank 0: what the other ranks need to run this pass."""
    pool = steps[0].cache.pool
    meta = []
    for st in steps:
        meta += [st.offset, st.start, st.length, len(st.cache.blocks), *st.cache.blocks]
    header = torch.tensor([OP_PASS, inputs.shape[0], len(steps), inputs.dim() == 2, pool.num_blocks,
                           pool.block_size, len(meta), 0], dtype=torch.long, device=wire)
    group.broadcast(header, 0).wait()
    group.broadcast(torch.tensor(meta, dtype=torch.long, device=wire), 0).wait()
    group.broadcast(inputs.to(wire).contiguous(), 0).wait()


def receive_pass(group, model: nn.Module, pool: KVPool | None, wire: torch.device
                 ) -> tuple[torch.Tensor, list[StepSlice], KVPool]:
    """Another rank: the next pass's inputs and steps, over its own pool (made or remade to rank 0's size)."""
    header = torch.empty(HEADER, dtype=torch.long, device=wire)
    group.broadcast(header, 0).wait()
    op, tokens, n_steps, hidden, num_blocks, block_size, meta_len, _ = header.tolist()
    if op != OP_PASS:
        raise RuntimeError(f"rank 0 sent op {op}, not a pass: the ranks are out of step")
    meta = torch.empty(meta_len, dtype=torch.long, device=wire)
    group.broadcast(meta, 0).wait()
    shape, dtype = ((tokens, model.args.hidden_size), model.dtype) if hidden else ((tokens,), torch.long)
    inputs = torch.empty(shape, dtype=dtype, device=wire)
    group.broadcast(inputs, 0).wait()
    if pool is None or pool.num_blocks != num_blocks or pool.block_size != block_size:
        a = model.args
        block_bytes = 2 * len(model.layers) * a.num_kv_heads * block_size * a.head_dim * model.dtype.itemsize
        pool = KVPool(num_blocks * block_bytes, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype,
                      model.device, block_size, 0)
    steps, values, i = [], meta.tolist(), 0
    for _ in range(n_steps):
        offset, start, length, n = values[i : i + 4]
        cache = SessionCache(pool, start + length, 0, values[i + 4 : i + 4 + n], start)
        steps.append(StepSlice(cache, offset, start, length))
        i += 4 + n
    return inputs.to(model.device), steps, pool


class TPGroup:
    """Rank 0's side of a tensor-parallel stage: starts the other ranks, joins their group, drives them
    (a forward pre-hook on its model) and watches them."""

    def __init__(self, spec: dict, device: torch.device,
                 on_rank_death: Callable[[str], None] | None = None):
        """spec: what every rank loads (stage_server/engine/tp_worker.py); spec["size"] ranks in all."""
        self.size, self.device = spec["size"], device
        self.backend = backend_for(device)
        self.wire = device if self.backend == "nccl" else torch.device("cpu")
        self.on_rank_death = on_rank_death or _exit_with_stage
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=GROUP_TIMEOUT,
                                   wait_for_workers=False)
        self.closing = False
        self.group = None
        self.pass_open = False  # a pass was broadcast and rank 0's forward of it has not ended
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.ranks = [
            subprocess.Popen([sys.executable, "-m", "stagemesh.stage_server.engine.tp_worker", json.dumps(
                {**spec, "rank": r, "port": self.store.port, "parent_pid": os.getpid(), "backend": self.backend})],
                env=env, stdin=subprocess.DEVNULL)
            for r in range(1, self.size)]
        self._watcher = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.ranks]

    def join(self, model: nn.Module) -> None:
        """Blocks until every rank has loaded and joined; then model's passes run on all ranks."""
        self.group = _group(self.backend, self.store, 0, self.size)
        shard_layers(model, self.group)
        model.register_forward_pre_hook(self._before_pass)
        model.register_forward_hook(self._after_pass)
        model.tp_group = self

    def _before_pass(self, model: nn.Module, args: tuple) -> tuple:
        inputs, steps = args
        if self.pass_open:
            self._out_of_step()
        if inputs.dim() == 2:
            inputs = inputs.to(model.dtype)  # as the ranks receive it (the model's own cast is then a no-op)
        self.pass_open = True
        send_pass(self.group, inputs, steps, self.wire)
        return inputs, steps

    def _after_pass(self, model: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.pass_open = False

    def _out_of_step(self) -> None:
        """The last pass failed on rank 0 after its broadcast: the other ranks wait in one of its collectives,
        and no later pass can line up with theirs. The stage goes down as one, as when a rank dies."""
        self.closing = True
        self._kill()
        self.on_rank_death("a pass failed on tensor-parallel rank 0 after it was sent to the other ranks (they are "
                           "out of step)")
        raise RuntimeError("the tensor-parallel ranks are out of step; the stage is stopping")

    def _watch(self) -> None:
        while not self.closing:
            for rank, proc in enumerate(self.ranks, start=1):
                code = proc.poll()
                if code is not None and not self.closing:
                    self.closing = True
                    self._kill()
                    self.on_rank_death(f"tensor-parallel rank {rank} exited (code {code})")
                    return
            time.sleep(WATCH_S)

    def _kill(self) -> None:
        for proc in self.ranks:
            if proc.poll() is None:
                proc.kill()
        for proc in self.ranks:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error(f"tensor-parallel rank process {proc.pid} did not exit after SIGKILL")

    def close(self) -> None:
        """Ends the other ranks (the slice is dropped or the stage stops)."""
        self.closing = True
        self._kill()


def _exit_with_stage(why: str) -> None:
    """A rank died, or the ranks are out of step: the stage goes down as one (no half-alive stage); a supervisor
    may start it again."""
    log.error(f"{why}: stopping the whole stage")
    logging.shutdown()
    os._exit(1)
