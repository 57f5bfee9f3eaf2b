"""The router and stages under real traffic: batching, chunked prefill, failover, priorities, load."""

from __future__ import annotations

import asyncio
import itertools
import random

import grpc
import pytest

from stagemesh.router.generation import GenerationConfig
from stagemesh.router.priority_queue import AdmissionConfig, ClassLimits
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.v1 import router_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh, until
from tests.test_exactness import prompt


def request(ids: list[int], n: int, **kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=n, **kw)


async def test_sixteen_batched_sessions_equal_one_at_a_time(tiny_model, hf_models):
    """Sixteen prompts one at a time, then all together: the same tokens as transformers both ways, and together
    the same steps took at most half the passes (one at a time, each pass carries one session's step), so the
    sessions' steps really shared passes."""
    mesh = await start_mesh(tiny_model, [splits(3, 5)], stage_options={"batcher": BatcherConfig(batch_window_ms=2)})
    try:
        prompts = [prompt(3 + 11 * i, seed=300 + i) for i in range(16)]
        expected = [hf_greedy(hf_models["llama"], p, 16) for p in prompts]
        stub = mesh.router_stub

        def passes() -> int:
            return sum(s.batcher.batches_run for s in mesh.all_stages())

        before = passes()
        alone = [(await collect(stub.Generate(request(p, 16))))[0] for p in prompts]
        passes_alone = passes() - before
        before = passes()
        together = await asyncio.gather(*(collect(stub.Generate(request(p, 16))) for p in prompts))
        passes_together = passes() - before
        assert alone == expected
        assert [t[0] for t in together] == expected
        assert passes_together <= passes_alone / 2, (passes_together, passes_alone)
    finally:
        await mesh.stop()


@pytest.mark.parametrize("chunk", [0, 1, 7, 64, 256])
async def test_chunked_prefill_equals_unchunked(tiny_model, hf_models, chunk):
    mesh = await start_mesh(tiny_model, [splits(2, 3, 3)],
                            router_options={"generation": GenerationConfig(prefill_chunk=chunk)})
    try:
        ids = prompt(300, seed=9)
        got, _, _ = await collect(mesh.router_stub.Generate(request(ids, 12)))
        assert got == hf_greedy(hf_models["llama"], ids, 12)
    finally:
        await mesh.stop()


async def test_long_prefill_does_not_block_short_requests(tiny_model):
    """A short request sent once a long prompt's chunked prefill is under way finishes while that prefill is still
    going: its steps share the stages' passes with the long prompt's chunks instead of waiting behind them."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)],
                            router_options={"generation": GenerationConfig(prefill_chunk=64)},
                            stage_options={"batcher": BatcherConfig(max_batch_tokens=64)})
    try:
        stub = mesh.router_stub
        first, last = mesh.stages[0]
        ids = prompt(1900, seed=1)

        def prefilled(stage) -> int:
            """The longest cache among the stage's sessions: the long prompt's, once it has one chunk in."""
            return max((s.cache.length for s in stage.sessions.sessions.values()), default=0)

        passes = first.batcher.batches_run
        long = asyncio.ensure_future(collect(stub.Generate(request(ids, 4))))
        await until(lambda: first.batcher.batches_run > passes and prefilled(last) < len(ids), 30,
                    "the long prompt's first pass done, its prefill not through the chain", every=0.002)
        short = await collect(stub.Generate(request([5, 6, 7], 8)))
        assert len(short[0]) == 8
        assert not long.done(), "the long request ended before the short one"
        assert prefilled(last) < len(ids), "the long prompt's prefill ended before the short request did"
        assert len((await long)[0]) == 4
    finally:
        await mesh.stop()


async def test_stream_survives_a_dead_stage_with_exact_tokens(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(2, 6)])
    try:
        ids = prompt(20, seed=4)
        expected = hf_greedy(hf_models["llama"], ids, 60)
        call = mesh.router_stub.Generate(request(ids, 60))
        got = []
        async for r in call:
            got.extend(r.token_ids)
            if len(got) == 10:
                # Kill the last stage of whichever chain carries the stream.
                busy = [c for c, chain in enumerate(mesh.stages) if len(chain[-1].sessions)]
                assert len(busy) == 1
                await mesh.stages[busy[0]][-1].stop(0)
        assert got == expected
        chains = (await mesh.router_stub.ListChains(router_pb2.ListChainsRequest())).chains
        assert sorted(c.healthy for c in chains) == [False, True]
    finally:
        await mesh.stop()


async def test_no_chain_left_gives_unavailable_not_a_hang(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        call = mesh.router_stub.Generate(request([5, 6, 7], 500), timeout=20)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                await mesh.stages[0][0].stop(0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "chain" in err.value.details()
    finally:
        await mesh.stop()


async def test_generate_batch_shards_over_chains_and_tags_results(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(5, 3)])
    try:
        prompts = [prompt(5 + i, seed=400 + i) for i in range(8)]
        batch = router_pb2.GenerateBatchRequest(requests=[request(p, 10) for p in prompts])
        batch.requests.append(request([5, 99999], 3))  # a bad one fails alone
        per_index: dict[int, list[int]] = {}
        errors = {}
        async for r in mesh.router_stub.GenerateBatch(batch):
            if r.error_code:
                errors[r.index] = r.error_message
            else:
                per_index.setdefault(r.index, []).extend(r.response.token_ids)
        assert [per_index[i] for i in range(8)] == [hf_greedy(hf_models["llama"], p, 10) for p in prompts]
        assert list(errors) == [8] and "vocabulary" in errors[8]
        assert all(s.batcher.batches_run > 0 for s in mesh.all_stages())  # both chains served
    finally:
        await mesh.stop()


async def test_requests_spread_over_chains(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(3, 5)])
    try:
        stub = mesh.router_stub
        opened = [0, 0]
        for _ in range(10):
            await asyncio.gather(*(collect(stub.Generate(request([5, 6, i], 4))) for i in range(4)))
        for c in range(2):
            opened[c] = mesh.stages[c][0].batcher.batches_run
        share = opened[0] / sum(opened)
        assert 0.25 < share < 0.75
    finally:
        await mesh.stop()


async def first_token_order(call, name: str, firsts: list[str]) -> list[int]:
    """Reads the stream to its end; appends name to firsts when its first token comes."""
    ids = []
    async for r in call:
        if not ids:
            firsts.append(name)
        ids.extend(r.token_ids)
    return ids


async def test_high_priority_gets_first_token_sooner_under_saturation(tiny_model):
    """Two slots, both held by normal requests with ten more normal ones queued behind them, then four high-priority
    ones: once the slots free up, all four high ones get their first token before any queued normal one does. (An
    order, not a ratio of times: the ratio moved with whatever else the machine ran while the rounds went by.)"""
    admission = AdmissionConfig(slots_per_chain=2)
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router_options={"admission": admission})
    try:
        stub = mesh.router_stub
        queue = mesh.router.admission
        holders = [stub.Generate(request([5, 6, i], 2000)) for i in range(2)]  # ended here, not by their length
        await until(lambda: queue.running == 2, 30, "two normal requests hold both slots")
        firsts: list[str] = []
        normal = [asyncio.ensure_future(first_token_order(stub.Generate(request([5, 6, i], 24)), "normal", firsts))
                  for i in range(10)]
        await until(lambda: queue.waiting_in("normal") == 10, 30, "ten normal requests wait")
        high = [asyncio.ensure_future(first_token_order(stub.Generate(request([7, 8, i], 24, priority=1)), "high",
                                                        firsts)) for i in range(4)]
        await until(lambda: queue.waiting_in("high") == 4, 30, "four high-priority requests wait")
        assert (queue.running, queue.waiting_in("normal")) == (2, 10), "a holder ended before the high ones came"
        for h in holders:
            h.cancel()
        await asyncio.gather(*normal, *high)
        assert firsts == ["high"] * 4 + ["normal"] * 10
    finally:
        await mesh.stop()


async def test_waiting_past_the_class_timeout_is_refused_clearly(tiny_model):
    """One slot, held: of three normal requests, two wait (the class's max_waiting) and are refused when their
    0.2 s in the queue are up, and the third is refused at once."""
    admission = AdmissionConfig(slots_per_chain=1, limits={
        "high": ClassLimits(), "normal": ClassLimits(max_waiting=2, max_wait_s=0.2), "batch": ClassLimits()})
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={"admission": admission})
    try:
        stub = mesh.router_stub
        running = stub.Generate(request([5, 6], 2000))  # holds the slot until cancelled here
        await until(lambda: mesh.router.admission.running == 1, 30, "a request holds the one slot")
        waiting = [asyncio.ensure_future(collect(stub.Generate(request([5, 7], 4)))) for _ in range(3)]
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), "a waiting request was let in and served"
        codes = sorted(r.code().name for r in results)
        assert codes == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"]
        assert all("queue" in r.details() for r in results)
        running.cancel()
    finally:
        await mesh.stop()


RANK = {"batch": 0, "normal": 1, "high": 2}


async def test_two_hundred_mixed_streams_complete_and_leave_nothing_behind(tiny_model):
    """200 streams of three priorities at once on 16 slots: all complete, nothing is left on the stages, and the
    queue let them in by class: whenever a request left the queue, none still waiting outranked it. (An order,
    looked at between the router's steps, not a ratio of times to the first token.)"""
    admission = AdmissionConfig(slots_per_chain=8, aging_s=600, limits={  # no wait here ages a class past another
        "high": ClassLimits(max_wait_s=120), "normal": ClassLimits(max_wait_s=120),
        "batch": ClassLimits(max_wait_s=120)})
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(4, 4)], router_options={"admission": admission})
    try:
        stub = mesh.router_stub
        queue = mesh.router.admission
        rng = random.Random(0)
        priorities = [rng.choice([1, 0, 0, -1]) for _ in range(200)]
        reqs = [request(prompt(rng.randint(4, 64), seed=i), rng.randint(4, 24), priority=p)
                for i, p in enumerate(priorities)]
        waiting: list[dict[int, str]] = []  # who waits (seq: class), at each look

        async def look(streams: asyncio.Future) -> None:
            for _ in range(int(240 / 0.005)):  # bounded by the streams' own timeout
                waiting.append({w.seq: w.cls for w in queue.waiting})
                if streams.done():
                    return
                await asyncio.sleep(0.005)

        streams = asyncio.ensure_future(asyncio.wait_for(
            asyncio.gather(*(collect(stub.Generate(r)) for r in reqs), return_exceptions=True), timeout=240))
        await look(streams)
        results = await streams
        failures = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(f, grpc.aio.AioRpcError) and f.details() for f in failures)
        assert len(failures) == 0
        assert any({"high", "normal"} <= set(w.values()) for w in waiting), "high and normal never waited together"
        for before, after in itertools.pairwise(waiting):
            let_in = [cls for seq, cls in before.items() if seq not in after]
            still = [cls for seq, cls in before.items() if seq in after]
            if let_in:
                outranked = max(map(RANK.get, still), default=-1) > min(map(RANK.get, let_in))
                assert not outranked, f"let in {let_in} while {still} waited"
        assert [(i.open_sessions, i.kv_used_bytes) for i in await mesh.settled_infos()] == [(0, 0)] * 4
    finally:
        await mesh.stop()
