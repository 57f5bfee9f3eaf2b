"""Every session is closed on every path out: done, cancelled, deadline, idle expiry."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh import wire
from stagemesh.discovery.chain_table import PublishedChain, PublishedStage
from stagemesh.router import chain_client
from stagemesh.router.chains import STAGE_SERVICE
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import StageSessions, collect, hf_greedy, splits, start_mesh, until


@pytest.fixture(scope="module")
async def mesh(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(2, 6)])
    yield mesh
    await mesh.stop()


async def open_sessions(mesh) -> list[int]:
    return [(await mesh.stage_stub(0, i).Info(stage_pb2.InfoRequest())).open_sessions for i in range(2)]


async def test_fifty_requests_leave_no_session_and_no_kv_in_use(mesh):
    stub = mesh.router_stub
    for batch in range(5):
        await asyncio.gather(*(
            collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[7, 8, batch * 10 + i], max_new_tokens=6)))
            for i in range(10)))
    assert [(i.open_sessions, i.kv_used_bytes) for i in await mesh.settled_infos()] == [(0, 0), (0, 0)]


async def test_cancelled_stream_frees_its_sessions(mesh):
    call = mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=1500))
    async for _ in call:
        break  # the first token arrived: the sessions are open
    assert await open_sessions(mesh) == [1, 1]
    call.cancel()
    assert [i.open_sessions for i in await mesh.settled_infos()] == [0, 0]


async def test_callers_that_leave_while_their_next_step_is_on_its_way_leave_nothing_behind(mesh, caplog):
    """The router sends a stream's next step before the caller's copy of its token (router/generation.py), so a
    caller that leaves always leaves a step in flight: six callers leaving after 1 to 16 tokens leave no session
    open on any stage, no step still running in the router (the mesh's router shares this event loop), and no step
    whose failure nobody read in its log."""
    calls = [mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[9, i, 3], max_new_tokens=500))
             for i in range(6)]

    async def leave_after(call, tokens: int) -> None:
        read = 0
        async for _ in call:
            read += 1
            if read == tokens:
                break
        call.cancel()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        await asyncio.gather(*(leave_after(call, 1 + 3 * i) for i, call in enumerate(calls)))
        assert [i.open_sessions for i in await mesh.settled_infos()] == [0, 0]
        steps = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("Session.step")]
        assert steps == []
        gc.collect()
        await asyncio.sleep(0.1)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


async def test_deadline_ends_the_stream_and_frees_its_sessions(mesh):
    """A deadline that passes mid-stream: DEADLINE_EXCEEDED, and the stream's sessions are closed. The deadline is
    paced by this machine: twice what 20 tokens take here, long past the first token and far short of 1900."""
    stub = mesh.router_stub
    t0 = time.monotonic()
    await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=20)))
    timeout = 2 * (time.monotonic() - t0)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=1900),
                                     timeout=timeout):
            got.extend(r.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(got) < 1900  # the stream was under way, its sessions open, when the deadline passed
    assert [i.open_sessions for i in await mesh.settled_infos()] == [0, 0]


async def test_idle_session_expires(tiny_model):
    short = await start_mesh(tiny_model, [splits(8)], router=False, stage_options={"session_timeout_s": 0.3})
    stub = short.stage_stub(0, 0)
    try:
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="idle", max_length=8))
        assert (await stub.Info(stage_pb2.InfoRequest())).open_sessions == 1
        [info] = await short.settled_infos()  # expired by the stage's sweep, which runs on its own clock
        assert (info.open_sessions, info.kv_used_bytes) == (0, 0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="idle"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await short.stop()


async def test_preloaded_stage_reports_its_cold_start(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)], router=False, stage_options={"preload": True})
    try:
        info = await mesh.stage_stub(0, 0).Info(stage_pb2.InfoRequest())
        assert 0 < info.load_s < 60
    finally:
        await mesh.stop()


async def test_a_chain_withdrawn_mid_stream_finishes_the_stream_then_closes_its_channels(tiny_model, hf_models,
                                                                                      caplog):
    own = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        chain = own.router.chains.chains[0]
        call = own.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=24))
        ids = list((await call.read()).token_ids)  # the stream is on the chain now
        own.router.chains.replace([])  # the scheduler stopped publishing it
        assert chain.withdrawn and all(s._channel is not None for s in chain.stages)
        while (response := await call.read()) is not grpc.aio.EOF:
            ids += response.token_ids
        assert ids == hf_greedy(hf_models["llama"], [5, 6, 7], 24)
        await until(lambda: not chain_client._closing, 10, "the closes begun as the stream ended have run")
        assert all(s._channel is None for s in chain.stages)
        gc.collect()
        # The stream's background CloseSession found its channel closed: that is expected, not an error.
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        await own.stop()


async def test_a_chain_withdrawn_and_published_again_mid_stream_still_counts_the_stream(tiny_model, hf_models):
    """A registry flap (a lapsed TTL under load) withdraws a chain and the scheduler publishes it again under the
    same id: the router takes back the same chain, so the stream running on it still counts against its slots
    and its channels stay open, rather than a fresh chain listing 0 streams in flight."""
    own = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        chain = own.router.chains.chains[0]
        published = PublishedChain(tuple(PublishedStage(f"s{i}", s.address, s.layer_start, s.layer_end)
                                         for i, s in enumerate(chain.stages)), chain.chain_id, chain.fingerprint)
        call = own.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=24))
        ids = list((await call.read()).token_ids)
        channels = [s.channel for s in chain.stages]
        own.router.chains.replace([])
        own.router.chains.replace([published])
        assert own.router.chains.chains == [chain] and not chain.withdrawn and chain.in_flight == 1
        while (response := await call.read()) is not grpc.aio.EOF:
            ids += response.token_ids
        assert ids == hf_greedy(hf_models["llama"], [5, 6, 7], 24)
        assert chain.in_flight == 0
        await until(lambda: not chain_client._closing, 10, "the closes begun as the stream ended have run")
        # A live chain keeps its channels: the same ones (a health check would reopen one closed meanwhile).
        assert all(s._channel is c for s, c in zip(chain.stages, channels, strict=True))
    finally:
        await own.stop()


async def test_a_draining_stage_lets_its_streams_end_and_takes_no_new_session(tiny_model, caplog):
    """Drain in the stage server: NOT_SERVING and no new session at once; open streams keep stepping; when
    the router ends them (it cancels a finished request's streams) the stage stops at once, and a stream's
    end that races the server's shutdown is no error (it was logged as one, now and then: a few rounds)."""
    greedy = stage_pb2.SamplingParams(temperature=0.0)

    def step(sid: str, start: int, ids: list[int]) -> stage_pb2.ForwardRequest:
        return stage_pb2.ForwardRequest(session_id=sid, start=start, sampling=greedy,
                                        token_ids=wire.encode_ids(ids))

    for _ in range(4):
        own = await start_mesh(tiny_model, [splits(8)], router=False)
        stage, stub = own.stages[0][0], own.stage_stub(0, 0)
        try:
            calls, tokens = [], []
            for i in range(4):
                await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id=f"open{i}", max_length=16))
                calls.append(StageSessions(stub))
                await calls[i].send(steps=[step(f"open{i}", 0, [5, 6, 7 + i])])
                tokens.append((await calls[i].read())[0].token_id)
            stopping = asyncio.ensure_future(stage.stop(30))
            await until(lambda stage=stage: stage.slot.draining, 10, "the stage drains")
            health = await health_pb2_grpc.HealthStub(own.channels[0]).Check(
                health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="new", max_length=16), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            for i, call in enumerate(calls):
                await call.send(steps=[step(f"open{i}", 3, [tokens[i]])])
                assert (await call.read())[0].session_id == f"open{i}"
            assert not stopping.done(), "the stage waits for its open streams"
            for call in calls:
                call.cancel()
                await asyncio.sleep(0.001)
            await asyncio.wait_for(stopping, 5)
            await asyncio.sleep(0.1)
        finally:
            await own.stop()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
