"""One request's failure stays with that request: a step that fails alone fails alone, the chain stays
usable, sampling is a function of (seed, position), a stopping batcher fails what it holds, and a step
left out of passes for lack of budget still runs."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from stagemesh.request_limits import InvalidSampling
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.stage_server.engine import sampling as sampling_module
from stagemesh.stage_server.engine.batcher import AGED_AFTER_PASSES, BatcherStopped, StepBatcher, StepRequest
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.sampling import Sampling
from stagemesh.stage_server.service.sessions import SessionTable
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt
from tests.test_traffic import request

POISON_SEED = 666


async def test_a_step_that_fails_alone_fails_alone_and_the_chain_stays_usable(tiny_model, hf_models, monkeypatch):
    """A bad value that slipped through validation raises inside the batched pass's sampling: only
    its request ends (with an error), six greedy streams in the same passes finish exactly, and the
    next request is served at once (the chain was not marked down)."""
    real_draw = sampling_module.draw_rows  # sample_rows draws a pass's rows with it, and one row at a time if it fails

    def draw_or_fail(logits, params, positions, histories=None):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("poisoned draw")
        return real_draw(logits, params, positions, histories)

    monkeypatch.setattr(sampling_module, "draw_rows", draw_or_fail)
    mesh = await start_mesh(tiny_model, [splits(3, 5)], stage_options={"batcher": BatcherConfig(batch_window_ms=3)})
    try:
        stub = mesh.router_stub
        prompts = [prompt(5 + 3 * i, seed=700 + i) for i in range(6)]
        greedy = [collect(stub.Generate(request(p, 12), timeout=60)) for p in prompts]
        poison = [collect(stub.Generate(request(prompt(9, seed=1), 12, temperature=0.8, seed=POISON_SEED),
                                        timeout=60)) for _ in range(2)]
        results = await asyncio.gather(*greedy, *poison, return_exceptions=True)
        for p, r in zip(prompts, results[:6], strict=True):
            assert not isinstance(r, BaseException), r
            assert r[0] == hf_greedy(hf_models["llama"], p, 12)
        for r in results[6:]:
            assert isinstance(r, grpc.aio.AioRpcError)
            assert r.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK)
            assert "poisoned draw" not in r.details()  # the stage's internals stay in its log
        # Served at once: the chain was not marked down for one request's failure.
        ids, _, _ = await collect(stub.Generate(request(prompts[0], 4), timeout=30))
        assert ids == hf_greedy(hf_models["llama"], prompts[0], 4)
        assert all(c.healthy for c in mesh.router.chains.chains)
    finally:
        await mesh.stop()


async def test_extreme_temperatures_are_served_or_refused_by_name(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        stub = mesh.router_stub
        ids = prompt(12, seed=3)
        tiny, _, _ = await collect(stub.Generate(request(ids, 8, temperature=1e-40, seed=1), timeout=30))
        assert tiny == hf_greedy(hf_models["llama"], ids, 8)  # as good as greedy, not a crash
        for bad in (math.nan, math.inf, -1.0, 1e6):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(request(ids, 4, temperature=bad), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request(ids, 4, temperature=0.5, top_p=math.nan), timeout=30))
        assert "top_p" in err.value.details()
    finally:
        await mesh.stop()


def test_sampling_bounds_are_checked_where_sampling_is_made():
    for bad in ({"temperature": math.nan}, {"temperature": -0.1}, {"top_k": -1}, {"top_p": 1.5}):
        with pytest.raises(InvalidSampling):
            Sampling(**bad)
    assert Sampling(temperature=0.0).greedy and not Sampling(temperature=0.5).greedy


async def test_a_seeded_stream_is_the_same_on_any_chain_and_across_a_failover(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(2, 6)])
    try:
        stub = mesh.router_stub
        ids = prompt(15, seed=11)
        seeded = request(ids, 40, temperature=0.9, top_k=50, seed=1234)
        first, _, _ = await collect(stub.Generate(seeded, timeout=60))
        second, _, _ = await collect(stub.Generate(seeded, timeout=60))
        other_seed, _, _ = await collect(stub.Generate(request(ids, 40, temperature=0.9, top_k=50, seed=99),
                                                       timeout=60))
        assert first == second and first != other_seed
        got = []
        async for r in stub.Generate(seeded, timeout=60):
            got.extend(r.token_ids)
            if len(got) == 10:  # kill the last stage of the chain carrying it: the stream moves
                busy = [c for c, chain in enumerate(mesh.stages) if len(chain[-1].sessions)]
                await mesh.stages[busy[0]][-1].stop(0)
        assert got == first
    finally:
        await mesh.stop()


@pytest.fixture(scope="module")
def whole_model(tiny_models):
    return load_stage(tiny_models["llama"], 0, None)


def _table(model) -> SessionTable:
    a = model.args
    return SessionTable(KVPool(64 << 20, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype), a.max_position)


async def test_stopping_the_batcher_fails_the_pass_in_flight_and_later_steps(whole_model, monkeypatch):
    sessions = _table(whole_model)
    batcher = StepBatcher(whole_model, BatcherConfig(), ThreadPoolExecutor(1))
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    real_run = batcher._run_isolated

    def slow_run(batch):  # a pass stuck on the compute thread until the test lets it go
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=30)
        return real_run(batch)

    monkeypatch.setattr(batcher, "_run_isolated", slow_run)
    batcher.start()
    try:
        session = sessions.open("s1", 64)
        step = asyncio.ensure_future(batcher.submit(StepRequest(session, 0, torch.tensor([5, 6, 7]))))
        for _ in range(200):  # bounded: wait until the pass is in flight
            if batcher.running:
                break
            await asyncio.sleep(0.01)
        assert batcher.running
        await batcher.stop()
        with pytest.raises(BatcherStopped):
            await asyncio.wait_for(step, 5)
        with pytest.raises(BatcherStopped):
            await asyncio.wait_for(batcher.submit(StepRequest(session, 0, torch.tensor([5]))), 5)
    finally:
        release.set()


def test_a_step_over_the_budget_left_by_decodes_runs_after_a_few_passes(whole_model):
    """Decode steps go first; a prefill chunk that never fits beside them ages until it goes first."""
    sessions = _table(whole_model)
    batcher = StepBatcher(whole_model, BatcherConfig(max_batch_tokens=16), ThreadPoolExecutor(1))
    decoders = [sessions.open(f"d{i}", 64) for i in range(4)]
    prefill = StepRequest(sessions.open("long", 64), 0, torch.arange(4, 20))  # 16 tokens: the whole budget
    batcher.queue.append(prefill)
    batches = []
    for _ in range(10):
        batcher.queue.extend(StepRequest(s, 0, torch.tensor([5])) for s in decoders)
        batches.append(batcher._take_batch())
        batcher.queue.clear()
        if prefill in batches[-1]:
            break
        batcher.queue.append(prefill)
    assert prefill in batches[-1] and len(batches) == AGED_AFTER_PASSES + 1
