"""What one pass takes. A stage before the last of its chain runs its decode steps in groups, so that the chain's
stages work on different groups at once instead of taking turns on one pass of every step; the last stage and a
lone stage take every waiting step; a CPU stage's passes hold 256 tokens unless told otherwise; tokens stay
exact."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stagemesh.stage_server.config import BatcherConfig
from stagemesh.stage_server.engine.batcher import StepBatcher, StepRequest
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.service.sessions import SessionTable
from stagemesh.v1 import stage_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt
from tests.test_traffic import request


@pytest.fixture(scope="module")
def first_and_last(tiny_models):
    return load_stage(tiny_models["llama"], 0, 4), load_stage(tiny_models["llama"], 4, None)


def _passes_of(model, config: BatcherConfig, open_sessions: int, waiting: int) -> list[int]:
    """How many decode steps each pass takes, with `open_sessions` open and the first `waiting` of them queued."""
    a = model.args
    table = SessionTable(KVPool(64 << 20, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype), a.max_position)
    sessions = [table.open(f"s{i}", 64) for i in range(open_sessions)]
    batcher = StepBatcher(model, config, ThreadPoolExecutor(1), open_sessions=lambda: len(table))
    batcher.queue.extend(StepRequest(s, 0, torch.tensor([5])) for s in sessions[:waiting])  # a decode step each
    passes = []
    for _ in range(waiting + 1):  # bounded: every pass takes at least one step
        if not batcher.queue:
            break
        passes.append(len(batcher._take_batch()))
    return passes


def test_a_stage_before_the_last_runs_a_groups_share_of_its_sessions_per_pass(first_and_last):
    first, last = first_and_last
    assert _passes_of(first, BatcherConfig(), open_sessions=40, waiting=40) == [20, 20]
    assert _passes_of(first, BatcherConfig(decode_groups=4, decode_group_min_rows=4), 40, 40) == [10, 10, 10, 10]
    # A group is never smaller than --decode-group-min-rows: small passes cost about what the weights take to read.
    assert _passes_of(first, BatcherConfig(), open_sessions=20, waiting=20) == [16, 4]
    assert _passes_of(first, BatcherConfig(), open_sessions=40, waiting=12) == [12]
    # One group: every waiting step in one pass, as does the last stage, whose output goes back to the router.
    assert _passes_of(first, BatcherConfig(decode_groups=1), open_sessions=40, waiting=40) == [40]
    assert _passes_of(last, BatcherConfig(), open_sessions=40, waiting=40) == [40]


def _pass_shapes(model, config: BatcherConfig, decoding: int, chunks: int, passes: int = 4) -> list[tuple[int, int]]:
    """(decode steps, prompt tokens) of each of up to `passes` passes: `decoding` streams that queue their next
    decode step as each pass ends (first in the queue at the start), and `chunks` prompts' 256-token chunks queued
    after them, one each."""
    a = model.args
    table = SessionTable(KVPool(64 << 20, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype), a.max_position)
    batcher = StepBatcher(model, config, ThreadPoolExecutor(1), open_sessions=lambda: len(table))
    batcher.queue.extend(StepRequest(table.open(f"d{i}", 64), 0, torch.tensor([5])) for i in range(decoding))
    batcher.queue.extend(StepRequest(table.open(f"p{i}", 512), 0, torch.full((256,), 5)) for i in range(chunks))
    shapes = []
    for _ in range(passes):
        if not batcher.queue:
            break
        batch = batcher._take_batch()
        shapes.append((sum(r.length == 1 for r in batch), sum(r.length for r in batch if r.length > 1)))
        batcher.queue.extend(StepRequest(r.session, 1, torch.tensor([5])) for r in batch if r.length == 1)
    return shapes


def test_a_cpu_stage_runs_passes_of_256_tokens_unless_told_otherwise(first_and_last):
    _, last = first_and_last
    assert (BatcherConfig().pass_tokens("cpu"), BatcherConfig().pass_tokens("cuda")) == (256, 2048)
    assert BatcherConfig(max_batch_tokens=64).pass_tokens("cuda") == 64
    # Three prompts' chunks: a pass each. Eight streams' next tokens go on in passes of their own; chunks that
    # have waited two passes go first, a pass each, and the streams' steps, aged by then, after them.
    assert _pass_shapes(last, BatcherConfig(), decoding=0, chunks=3) == [(0, 256)] * 3
    assert _pass_shapes(last, BatcherConfig(), decoding=8, chunks=2, passes=5) == [
        (8, 0), (8, 0), (0, 256), (0, 256), (8, 0)]
    # With the budget a CUDA stage has by default, chunks go together and join the decode steps.
    assert _pass_shapes(last, BatcherConfig(max_batch_tokens=2048), decoding=0, chunks=3) == [(0, 768)]
    assert _pass_shapes(last, BatcherConfig(max_batch_tokens=2048), decoding=8, chunks=2, passes=2) == [
        (8, 512), (8, 0)]


def test_the_knobs_refuse_what_cannot_group():
    with pytest.raises(ValueError, match="--decode-groups 0: must be >= 1"):
        BatcherConfig(decode_groups=0)
    with pytest.raises(ValueError, match="--decode-group-min-rows 0: must be >= 1"):
        BatcherConfig(decode_group_min_rows=0)


async def test_streams_decoded_in_groups_are_exact(tiny_model, hf_models, monkeypatch):
    """Eight streams through a 2-stage chain whose first stage runs groups of at most half its sessions: every
    stream's greedy tokens are transformers', and no decode pass of the first stage took more than a group."""
    config = BatcherConfig(decode_groups=2, decode_group_min_rows=1)
    mesh = await start_mesh(tiny_model, [splits(3, 5)], stage_options={"batcher": config})
    try:
        # No --max-batch-tokens: a CPU stage's budget, as Info reports it and the router's chain adopts it.
        assert (await mesh.stage_stub(0, 0).Info(stage_pb2.InfoRequest())).max_batch_tokens == 256
        assert mesh.router.chains.chains[0].max_batch_tokens == 256
        batcher = mesh.stages[0][0].batcher
        decode_passes: list[tuple[int, int]] = []  # (steps, sessions open)
        real_passed = batcher._passed

        def passed(batch, took):
            if all(r.length == 1 for r in batch):
                decode_passes.append((len(batch), batcher.open_sessions()))
            real_passed(batch, took)

        monkeypatch.setattr(batcher, "_passed", passed)
        prompts = [prompt(6 + 2 * i, seed=900 + i) for i in range(8)]
        results = await asyncio.gather(*(collect(mesh.router_stub.Generate(request(p, 16), timeout=60))
                                         for p in prompts))
        for p, (ids, _, _) in zip(prompts, results, strict=True):
            assert ids == hf_greedy(hf_models["llama"], p, 16)
        assert decode_passes
        assert all(steps <= -(-open_ // 2) for steps, open_ in decode_passes), decode_passes
    finally:
        await mesh.stop()
