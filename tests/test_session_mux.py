"""Stage/Sessions: a router's forwarding sessions on one long-lived stream per stage. Many sessions on
one stream are exact against transformers; a session's bad step, open or outsider's step is refused to
that session only; the stream's end closes every session it carried."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from stagemesh import grpc_server
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.stage_server.service import session_stream
from stagemesh.v1 import stage_pb2
from tests.conftest import hf_greedy
from tests.test_exactness import prompt
from tests.test_forwarding import one_chain, open_sessions, until_empty
from tests.test_identity import other_connection


def streams_on(stage) -> int:
    """Sessions streams the stage serves now."""
    return len(session_stream._streams.get(stage.slot.current, ()))


async def greedy(session: ChainSession, ids: list[int], n: int) -> list[int]:
    tokens = [(await session.step(ids, sampling=Sampling(), chunk_size=4)).token_id]
    while len(tokens) < n:
        tokens.append((await session.step(tokens[-1:], sampling=Sampling())).token_id)
    return tokens


@pytest.mark.parametrize("n_stages", [2, 3])
async def test_many_sessions_on_one_stream_per_stage_equal_transformers(tiny_model, hf_models, n_stages):
    prompts = [prompt(3 + 4 * i, seed=60 + i) for i in range(10)]
    async with one_chain(tiny_model, n_stages) as (mesh, chain):
        async def run(p: list[int]) -> list[int]:
            async with ChainSession(chain, 64, "mux") as session:
                return await greedy(session, p, 8)

        got = await asyncio.gather(*(run(p) for p in prompts))
        assert got == [hf_greedy(hf_models["llama"], p, 8) for p in prompts]
        assert [streams_on(s) for s in mesh.stages[0]] == [1] * n_stages  # one stream per stage, all sessions
        await until_empty(mesh)
        assert [streams_on(s) for s in mesh.stages[0]] == [1] * n_stages  # closing sessions kept it


async def test_a_bad_step_or_open_costs_only_its_session(tiny_model, hf_models):
    ids = prompt(9, seed=61)
    async with one_chain(tiny_model, 2) as (mesh, chain):
        async with ChainSession(chain, 64, "bystander") as bystander:
            tokens = [(await bystander.step(ids, sampling=Sampling())).token_id]
            # Checked on arrival (a token outside the vocabulary), or in the step's own task (a wrong position).
            for bad, skip, words in (([10**6], 0, "outside the vocabulary"), ([5], 3, "step starts at position")):
                async with ChainSession(chain, 64, "victim") as victim:
                    await victim.step(ids, sampling=Sampling())
                    victim.position += skip
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await victim.step(bad, sampling=Sampling())
                    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert words in failed.value.details() and chain.stages[0].address in failed.value.details()
                tokens.append((await bystander.step(tokens[-1:], sampling=Sampling())).token_id)
            # A session of more positions than the model has: refused at open, by the first stage (chain order).
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async with ChainSession(chain, 10**6, "too-long"):
                    pass
            assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert chain.stages[0].address in refused.value.details()
            for _ in range(3):
                tokens.append((await bystander.step(tokens[-1:], sampling=Sampling())).token_id)
        assert tokens == hf_greedy(hf_models["llama"], ids, 6)
        await until_empty(mesh)


async def test_an_outsider_on_its_own_stream_cannot_step_reroute_or_close_a_session(tiny_model, hf_models):
    ids = prompt(9, seed=62)
    async with one_chain(tiny_model, 2) as (mesh, chain):
        async with ChainSession(chain, 64, "owned") as session:
            tokens = [(await session.step(ids, sampling=Sampling())).token_id]
            sid = session.session_id
            step = stage_pb2.ForwardRequest(session_id=sid, start=len(ids))
            step.token_ids.dtype, step.token_ids.data = "int64", bytes(8)
            step.token_ids.shape.append(1)
            reroute = stage_pb2.Reroute(session_id=sid, position=0, next_address="127.0.0.1:9", next_key="x")
            batches = [stage_pb2.SessionBatch(steps=[step], reroute=[reroute], close=[sid])]
            outsider = other_connection(chain.stages[0].address).Sessions(iter(batches), timeout=10)
            events = [e async for e in outsider]  # answered, then the stream ends as its caller did
            assert [(f.session_id, f.code) for e in events for f in e.faults] == [
                (sid, grpc.StatusCode.NOT_FOUND.value[0])] * 2
            assert not any(e.rerouted for e in events)
            for _ in range(5):  # the owner's session was neither stepped, rewound, re-pointed nor closed
                tokens.append((await session.step(tokens[-1:], sampling=Sampling())).token_id)
        assert tokens == hf_greedy(hf_models["llama"], ids, 6)
        await until_empty(mesh)


async def test_the_streams_end_closes_every_session_it_carried(tiny_model):
    async with one_chain(tiny_model, 3) as (mesh, chain):
        sessions = [ChainSession(chain, 64, f"s{i}") for i in range(4)]
        for session in sessions:
            await session.__aenter__()
            await session.step(prompt(5, seed=63), sampling=Sampling())
        assert open_sessions(mesh) == 12
        for stage in chain.stages:  # the router's connections go (it stopped, or its host did)
            await stage.close()
        await until_empty(mesh)
        stubs = [mesh.stage_stub(0, i) for i in range(3)]
        assert [(await s.Info(stage_pb2.InfoRequest(), timeout=10)).open_sessions for s in stubs] == [0, 0, 0]
        # Their router hears it on the next step, naming the first stage (its stream to it ended).
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await sessions[0].step([5], sampling=Sampling())
        assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        for session in sessions:
            await session.close()


def test_a_stream_holds_a_message_for_company_only_while_it_carries_several_sessions():
    wait = grpc_server.BUSY_STREAM_WAIT_S
    # A lone session's step goes at once, however soon after the last: on a host that makes its tokens
    # faster than the wait, it would otherwise wait at every hop of every token.
    assert grpc_server.busy_wait_s(1, 0.0) == 0.0
    assert grpc_server.busy_wait_s(0, 0.0) == 0.0
    # Many sessions, the last message just written: the next waits so that more sessions' traffic joins it.
    assert grpc_server.busy_wait_s(32, wait / 10) == wait
    # Many sessions, idle since the last message: at once.
    assert grpc_server.busy_wait_s(32, 2 * wait) == 0.0


async def test_a_lone_sessions_decode_steps_skip_the_queue_and_stay_exact(tiny_model, hf_models, monkeypatch):
    """A stage serving one session runs its decode steps at once, on the stack that read them (StepBatcher.run_now);
    two sessions' steps go through the queue, batched. Tokens equal transformers' either way."""
    async with one_chain(tiny_model, 2) as (mesh, chain):
        at_once = []
        for stage in mesh.stages[0]:
            # This process runs torch on 2 threads, where a stage keeps torch work off its event loop; a 1-thread
            # stage (the launcher's on 2 cores) runs a lone short decode step inline, and so may skip the queue.
            # Any pass counts as short here, however slow the machine.
            stage.batcher.may_inline = True
            stage.batcher.config = BatcherConfig(inline_max_ms=60_000.0)
            run_now = stage.batcher.run_now
            monkeypatch.setattr(stage.batcher, "run_now", lambda req, run=run_now: at_once.append(req) or run(req))
        ids = prompt(9, seed=64)
        async with ChainSession(chain, 64, "lone") as session:
            assert await greedy(session, ids, 8) == hf_greedy(hf_models["llama"], ids, 8)
        assert len(at_once) >= 2 * 5  # both stages, every decode step after the first (which sets the pass time)
        at_once.clear()
        prompts = [prompt(5, seed=65), prompt(7, seed=66)]
        async with ChainSession(chain, 64, "a") as a, ChainSession(chain, 64, "b") as b:
            got = await asyncio.gather(greedy(a, prompts[0], 6), greedy(b, prompts[1], 6))
        assert got == [hf_greedy(hf_models["llama"], p, 6) for p in prompts]
        assert not at_once
        await until_empty(mesh)
