"""Repair: when one stage of a chain dies mid-stream, another chain's stage of the same layers takes its place
and only it is rebuilt, from the previous stage's output log; the stream goes on exact (tokens identical to
transformers, logits within 1e-4), the stages after it keep their KV caches, and every session is closed after.
The output log itself: bounded, freed with its session, readable by the session's opener only."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from stagemesh import grpc_server, metrics, wire
from stagemesh.router import repair
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.service.output_log import OutputLog, RepairLog
from stagemesh.stage_server.service.sessions import SessionTable
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import StageSessions, collect, hf_greedy, splits, start_mesh, until
from tests.harness.fault_mesh import FaultMesh
from tests.test_exactness import prompt
from tests.test_fault_suite import _until
from tests.test_identity import other_connection

LAYOUT = splits(2, 3, 3)
NEW_TOKENS = 40


async def assert_repaired_exactly(hf, ids: list[int], tokens: list[int], got: list, mesh, dead: int) -> None:
    """A session repaired around chain 0's stage `dead`: every step's logits within 1e-4 of transformers, the
    greedy tokens its, and every live stage's sessions closed and output logs freed (the closes go out in the
    background: polled, bounded)."""
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)
    assert tokens[len(ids):] == hf_greedy(hf, ids, len(got))
    live = [s for c in mesh.stages for s in c if s is not mesh.stages[0][dead]]
    for _ in range(200):
        if not any(len(s.sessions) for s in live):
            break
        await asyncio.sleep(0.02)
    assert [len(s.sessions) for s in live] == [0] * 5  # 2 chains of 3 stages, one stopped
    assert all(s.sessions.log_budget.used_bytes == 0 for s in live)


def test_the_chunked_output_log_reads_what_was_written_across_chunks_and_reuse(caplog):
    """Sessions' logs share one RepairLog of fixed-size chunks: writes that cross chunk bounds (and chunks given
    back by one session, taken by another in another order) read back exactly, position for position; a log that
    finds no free chunk is dropped whole, counted by reason, its chunks returned; so is one with a gap."""
    caplog.set_level(logging.INFO, logger="stagemesh")
    hidden = 4
    budget = RepairLog(40, hidden, torch.float32, chunk_tokens=8)  # 5 chunks of 8
    assert (budget.capacity_tokens, budget.capacity_bytes, budget.used_bytes) == (40, 40 * 16, 0)
    rows = torch.randn(64, hidden)
    a, b = OutputLog(budget), OutputLog(budget)
    a.append(0, rows[:3])  # within chunk 0
    b.append(0, rows[:11])  # crosses into b's 2nd chunk
    a.append(3, rows[3:13])  # 3..12: the rest of a's 1st chunk, then its 2nd
    a.append(13, rows[13:14])
    assert a.chunks[1] != a.chunks[0] + 1  # b's chunks between: a's read is stitched from two runs
    assert a.length == 14 and a.covers(0, 14) and not a.covers(0, 15)
    assert [(at, r.shape[0]) for at, r in a.read(0, 14, 5)] == [(0, 5), (5, 5), (10, 4)]
    assert torch.equal(torch.cat([r for _, r in a.read(0, 14, 5)]), rows[:14])
    assert torch.equal(torch.cat([r for _, r in b.read(2, 11, 3)]), rows[2:11])
    assert budget.used_bytes == 4 * 8 * hidden * 4
    a.length = 6  # a rewind (SessionBatch.reroute): 6.. are written again, in the chunks it holds
    a.append(6, -rows[6:20])
    assert torch.equal(next(a.read(0, 20, 20))[1], torch.cat([rows[:6], -rows[6:20]]))
    b.drop()  # b's chunks go back and are taken by c, written over
    c = OutputLog(budget)
    c.append(0, rows[40:56])
    assert torch.equal(next(c.read(0, 16, 16))[1], rows[40:56])
    assert torch.equal(next(a.read(0, 20, 20))[1], torch.cat([rows[:6], -rows[6:20]]))  # a's rows untouched
    dropped = metrics.OUTPUT_LOG_DROPPED.labels("full")._value.get()
    a.append(20, rows[:30])  # needs 4 more chunks, 1 is free: given up whole
    assert a.lost and not a.covers(0, 1) and budget.dropped == 1
    assert metrics.OUTPUT_LOG_DROPPED.labels("full")._value.get() == dropped + 1
    assert budget.used_bytes == 2 * 8 * hidden * 4  # c's two chunks
    gap = OutputLog(budget)
    gap.append(0, rows[:2])
    gap.append(5, rows[:1])  # a gap: useless for a rebuild, dropped
    assert gap.lost and budget.dropped == 2 and budget.used_bytes == 2 * 8 * hidden * 4
    said = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records}  # full: a warning; a gap: only info
    assert said == {"output log dropped (full)": logging.WARNING, "output log dropped (gap)": logging.INFO}
    c.drop()
    assert budget.used_bytes == 0 and sorted(budget.free) == list(range(5))
    pool = KVPool(1 << 20, 1, 1, 4, torch.float32, block_size=8)
    assert SessionTable(pool, 64, RepairLog(0, hidden, torch.float32)).open("none", 8, keep_output=True).output is None
    assert SessionTable(pool, 64, budget).open("kept", 8, keep_output=True).output is not None


@pytest.fixture(scope="module")
async def twin(tiny_model):
    """Two chains of the same three ranges, in this process."""
    mesh = await start_mesh(tiny_model, [LAYOUT, LAYOUT], router=False)
    yield mesh
    await mesh.stop()


def endpoints(servers) -> list[StageEndpoint]:
    return [StageEndpoint(s.address, a, b) for s, (a, b) in zip(servers, LAYOUT, strict=True)]


async def test_rebuilt_kv_equals_the_stepped_kv(twin):
    """A stage rebuilt by prefill of the logged inputs holds the same K/V as the stage that took them one
    decode step at a time (up to float rounding)."""
    a, b = twin.stages[0], twin.stages[1]
    session = ChainSession(Chain(endpoints(a)), max_length=64, request_id="kv-test", keep_output=True)
    async with session:
        feed = prompt(10, seed=5)
        history = list(feed)
        for _ in range(6):
            token = (await session.step(feed, sampling=Sampling())).token_id
            history.append(token)
            feed = [token]
        fed = session.position  # every stage holds positions 0..fed-1; history's last token is not fed yet
        session.failed_stage = 1
        k_old, v_old = _kv(a[1].sessions.pool, a[1].sessions.sessions[session.session_id].cache, fed)
        await repair.repair(session, endpoints(b)[1], history, 4)  # b[1] rebuilt, then the last token goes through
        new = b[1].sessions.sessions[session.session_id].cache
        assert new.length == fed + 1
        k_new, v_new = _kv(b[1].sessions.pool, new, fed)
        torch.testing.assert_close(k_new, k_old, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_new, v_old, atol=1e-5, rtol=1e-5)


def _kv(pool, cache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A session's K and V of positions 0..n-1, from the pool: [layers, n, kv_heads, head_dim] each."""
    slots = torch.tensor([cache.blocks[p // pool.block_size] * pool.block_size + p % pool.block_size
                          for p in range(n)])
    return pool.k[:, slots], pool.v[:, slots]


async def test_the_output_log_is_its_openers_and_only_if_asked(twin):
    stage = twin.stages[0][0]
    keep = stage_pb2.OpenSessionRequest(session_id="log-owner", max_length=32, keep_output=True)
    plain = stage_pb2.OpenSessionRequest(session_id="log-none", max_length=32)
    stub = twin.stage_stub(0, 0)
    await stub.OpenSession(keep)
    await stub.OpenSession(plain)
    call = StageSessions(stub)
    await call.send(steps=[stage_pb2.ForwardRequest(session_id=sid, start=0, token_ids=wire.encode_ids([5, 6, 7]))
                           for sid in ("log-owner", "log-none")])
    await until(lambda: all(stage.sessions.sessions[sid].cache.length == 3 for sid in ("log-owner", "log-none")),
                30, "both steps ran")
    chunks = [c async for c in stub.ReadOutput(stage_pb2.ReadOutputRequest(session_id="log-owner", end=3,
                                                                            chunk_tokens=2))]
    assert [(c.start, list(c.hidden.shape)) for c in chunks] == [(0, [2, 256]), (2, [1, 256])]
    assert (await stub.Info(stage_pb2.InfoRequest())).output_log_bytes > 0
    with pytest.raises(grpc.aio.AioRpcError) as none:
        [c async for c in stub.ReadOutput(stage_pb2.ReadOutputRequest(session_id="log-none", end=3))]
    assert none.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as past:
        [c async for c in stub.ReadOutput(stage_pb2.ReadOutputRequest(session_id="log-owner", end=4))]
    assert past.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stranger = other_connection(stage.address)
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        [c async for c in stranger.ReadOutput(stage_pb2.ReadOutputRequest(session_id="log-owner", end=3))]
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    call.cancel()
    for _ in range(100):
        if not stage.sessions.sessions:
            break
        await asyncio.sleep(0.02)
    assert stage.sessions.log_budget.used_bytes == 0


async def test_a_forwarding_stream_is_repaired_exact_and_every_session_closed_after(tiny_model, hf_models, caplog):
    """A forwarding session (the router's default) asks its non-last stages for output logs; when its middle stage
    stops mid-stream, the other chain's stage takes its place (router/repair.py repair), exact, with
    no replay; the stages after it keep the session, and every session is closed when the stream ends."""
    caplog.set_level(logging.INFO, logger="stagemesh.router")
    mesh = await start_mesh(tiny_model, [LAYOUT, LAYOUT])
    try:
        ids = prompt(30, seed=90)
        call = mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=NEW_TOKENS))
        got = []
        while len(got) < 5:
            got.extend((await call.read()).token_ids)
        chain = next(c for c in mesh.stages if c[1].sessions.sessions)
        assert [s.output is not None for s in chain[0].sessions.sessions.values()] == [True]
        last = next(iter(chain[2].sessions.sessions.values())).cache
        await chain[1].stop(0)
        while (response := await call.read()) is not grpc.aio.EOF:
            got.extend(response.token_ids)
        assert got == hf_greedy(hf_models["llama"], ids, NEW_TOKENS)
        assert "takes its place" in caplog.text and "replaying" not in caplog.text
        assert last.length == len(ids) + NEW_TOKENS - 1  # the last stage kept its cache to the end
        live = [s for c in mesh.stages for s in c if s is not chain[1]]
        for _ in range(200):
            if not any(len(s.sessions) for s in live):
                break
            await asyncio.sleep(0.02)
        assert [len(s.sessions) for s in live] == [0] * 5
        assert all(s.sessions.log_budget.used_bytes == 0 for s in live)
    finally:
        await mesh.stop()


async def test_a_next_stage_that_lost_the_session_leaves_it_to_the_routers_repair(tiny_model, hf_models, caplog):
    """The router's stream to a middle stage ends (the stage keeps serving but closed the sessions it carried, as
    a stage that stops or swaps its slice does); the first stage's next relayed step is refused there (NOT_FOUND).
    A repairable session outlives that refusal at the first stage, as it outlives a broken link: the router hears
    the middle stage itself, and the repair re-points the first stage at the new one, exact (CI's race: the
    refusal closed the first stage's session, and the stream was replayed instead)."""
    caplog.set_level(logging.INFO, logger="stagemesh.stage")
    mesh = await start_mesh(tiny_model, [LAYOUT, LAYOUT], router=False)
    try:
        a = mesh.stages[0]
        chain = Chain([StageEndpoint(s.address, lo, hi) for s, (lo, hi) in zip(a, LAYOUT, strict=True)])
        spare = endpoints(mesh.stages[1])[1]
        ids = prompt(20, seed=95)
        history = list(ids)
        async with ChainSession(chain, 96, "refused", keep_output=True) as session:
            history.append((await session.step(ids, sampling=Sampling(), chunk_size=8)).token_id)
            history.append((await session.step(history[-1:], sampling=Sampling())).token_id)
            session.muxes[1].call.cancel()  # the router's stream to the middle stage ends
            await _until(lambda: _closed(a[1]), 10, "the middle stage closed the session")
            with pytest.raises(grpc.aio.AioRpcError):
                await session.step(history[-1:], sampling=Sampling())
            assert session.failed_stage == 1
            refused = f"next stage {a[1].address}"
            await _until(lambda: _logged(caplog, refused), 10, "the first stage heard the refusal")
            assert session.session_id in a[0].sessions.sessions  # kept for the router's repair
            history.append((await repair.repair(session, spare, history, 8)).token_id)
            while len(history) < len(ids) + 12:
                history.append((await session.step(history[-1:], sampling=Sampling())).token_id)
        assert history[len(ids):] == hf_greedy(hf_models["llama"], ids, 12)
    finally:
        await mesh.stop()


async def _closed(stage) -> bool:
    return not stage.sessions.sessions


async def _logged(caplog, text: str) -> bool:
    return text in caplog.text


# The process test: two chains of three stages (real processes behind link proxies), the middle stage of the
# busier chain SIGKILLed mid-stream.


@pytest.fixture(scope="module")
def pm3(tiny_model, tmp_path_factory):
    mesh = FaultMesh(str(tiny_model), tmp_path_factory.mktemp("repair-logs"), chains=2, stages=3, num_layers=8,
                     stage_args=("--kv-cache-gb", "0.02"),
                     router_args=("--health-interval-s", "0.2", "--step-timeout-s", "5"))
    yield mesh
    mesh.stop()


async def test_sigkill_of_a_middle_stage_is_repaired_not_replayed(pm3, hf_models):
    """With the prefix cache on: the streams start from their prompts' cached blocks (so no stage logged them),
    and the new middle stage is rebuilt by the first stage computing them again."""
    prompts = [prompt(30 + 7 * i, seed=500 + i) for i in range(3)]
    wanted = [hf_greedy(hf_models["llama"], p, NEW_TOKENS) for p in prompts]
    async with grpc_server.insecure_channel(pm3.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def healthy() -> bool:
            try:
                listed = await stub.ListChains(router_pb2.ListChainsRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return sum(c.healthy for c in listed.chains) == 2

        await _until(healthy, 60, "both chains healthy")

        async def cached() -> bool:  # every prompt's full blocks (of 16) on both chains' first stages
            for ids in prompts:  # two at a time: the router spreads them over both chains
                once = router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=1)
                await asyncio.gather(*(collect(stub.Generate(once, timeout=60)) for _ in range(2)))
            firsts = await asyncio.to_thread(lambda: [_info(pm3.ports[i]) for i in (0, 3)])
            return all(i.kv_prefix_blocks >= sum((len(p) - 1) // 16 for p in prompts) for i in firsts)

        await _until(cached, 60, "the prompts cached on both chains")
        repairs, failovers = (pm3.router_counter(f"stagemesh_router_{n}") for n in ("repairs", "failovers"))
        started = [asyncio.Event() for _ in prompts]

        attached = []

        async def stream(ids, running):
            got = []
            async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=NEW_TOKENS),
                                         timeout=90):
                got.extend(r.token_ids)
                if len(got) >= 5:
                    running.set()
            attached.append(r.cached_tokens)
            return got

        streams = [asyncio.ensure_future(stream(p, r)) for p, r in zip(prompts, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in started)), 60)
        victim = pm3.busy_stage(1)
        await asyncio.to_thread(pm3.inject, "sigkill", victim)
        results = await asyncio.gather(*streams)
    assert results == wanted
    assert all(attached), attached  # every stream started from its prompt's cached blocks
    live = [p for i, p in enumerate(pm3.ports) if i != victim]

    async def all_closed() -> bool:
        return all(i.open_sessions == 0 and i.kv_used_bytes == 0 and i.output_log_bytes == 0
                   for i in await asyncio.to_thread(lambda: [_info(port) for port in live]))

    await _until(all_closed, 20, "every live stage back to 0 sessions, KV bytes and log bytes")
    assert pm3.router_counter("stagemesh_router_repairs") > repairs, "no stream was repaired"
    assert pm3.router_counter("stagemesh_router_failovers") == failovers, "a stream was replayed on another chain"


def _info(port: int) -> stage_pb2.StageInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=5)
