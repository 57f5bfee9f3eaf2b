"""Forwarding: stages send hidden states straight to the next stage, the last sends the token back.
Exact against transformers (chunked prefill, batching, 2 and 3 stages), faults of a middle stage
(SIGKILL, SIGSTOP, a cut link) finish exact on another chain, an ill-formed Relay message costs only its
session, and no one but the chosen neighbour steps a forwarded session."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.generation import GenerationConfig
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh, step_status, until
from tests.harness.fault_mesh import FaultMesh
from tests.harness.link_proxy import LinkProxy
from tests.test_exactness import prompt
from tests.test_fault_suite import _fault
from tests.test_fault_suite import expected as expected  # the fixture, shared
from tests.test_identity import other_connection

LAYOUTS = {2: splits(3, 5), 3: splits(2, 3, 3)}


def open_sessions(mesh) -> int:
    return sum(len(s.sessions) for s in mesh.all_stages())


@contextlib.asynccontextmanager
async def one_chain(tiny_model, n_stages: int, **stage_options):
    """A mesh of one chain of n_stages stage servers (no router) and the router's Chain of it; closed after."""
    mesh = await start_mesh(tiny_model, [LAYOUTS[n_stages]], router=False, stage_options=stage_options or None)
    chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
    try:
        yield mesh, chain
    finally:
        for stage in chain.stages:
            await stage.close()
        await mesh.stop()


async def until_empty(mesh) -> None:
    for _ in range(500):
        if open_sessions(mesh) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{open_sessions(mesh)} sessions still open")


@pytest.mark.parametrize("n_stages", sorted(LAYOUTS))
async def test_streams_equal_transformers_with_chunked_prefill_and_batching(tiny_model, hf_models, n_stages):
    mesh = await start_mesh(tiny_model, [LAYOUTS[n_stages]], router_options={
        "generation": GenerationConfig(prefill_chunk=7)})
    try:
        prompts = [prompt(5 + 9 * i, seed=40 + i) for i in range(6)]  # 5..50 tokens: 1 to 8 chunks
        stub = mesh.router_stub
        got = await asyncio.gather(*(collect(stub.Generate(router_pb2.GenerateRequest(token_ids=p, max_new_tokens=20)))
                                     for p in prompts))
        for p, (ids, _, _) in zip(prompts, got, strict=True):
            assert ids == hf_greedy(hf_models["llama"], p, 20)
        # Forwarding really went stage to stage: every stage but the last holds a link to its next one.
        linked = [bool(s.slot.current.links.links) for s in mesh.stages[0]]
        assert linked == [True] * (n_stages - 1) + [False]
        await until_empty(mesh)
    finally:
        await mesh.stop()


async def test_forwarded_logits_match_transformers_within_1e_4(tiny_model, hf_models):
    async with one_chain(tiny_model, 3) as (mesh, chain):
        ids = prompt(23, seed=5)
        logits, tokens = [], list(ids)
        async with ChainSession(chain, 64, "fwd-logits") as session:
            feed = ids
            for _ in range(6):
                result = await session.step(feed, sampling=Sampling(), chunk_size=5, return_logits=True)
                logits.append(tensor_codec.decode(result.logits))
                tokens.append(result.token_id)
                feed = [result.token_id]
        with torch.inference_mode():
            ref = hf_models["llama"](torch.tensor([tokens])).logits[0]
        for k, got in enumerate(logits):
            torch.testing.assert_close(got, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)
        await until_empty(mesh)


async def test_an_outsider_cannot_step_or_close_a_forwarded_session(tiny_model, hf_models):
    ids = prompt(9, seed=6)
    async with one_chain(tiny_model, 2) as (mesh, chain):
        async with ChainSession(chain, 64, "owned") as session:
            tokens = [(await session.step(ids, sampling=Sampling())).token_id]
            outsider = other_connection(chain.stages[1].address)
            hidden = tensor_codec.encode(torch.zeros(1, 256))
            sid = session.session_id
            step = stage_pb2.ForwardRequest(session_id=sid, start=len(ids), hidden=hidden)
            assert await step_status(outsider, step) == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await outsider.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid), timeout=10)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            # On Relay, the session id without its hop key (or with another session's) is an unknown session.
            for key in ("", "0" * 32, session.hop_keys[1][::-1]):
                relayed = stage_pb2.ForwardRequest(session_id=sid, start=len(ids), hidden=hidden, hop_key=key)
                statuses = [s async for s in outsider.Relay(iter([stage_pb2.RelayBatch(steps=[relayed])]), timeout=10)]
                assert [s.code for s in statuses] == [grpc.StatusCode.NOT_FOUND.value[0]]
            # The owner's stream was not disturbed.
            for _ in range(5):
                tokens.append((await session.step(tokens[-1:], sampling=Sampling())).token_id)
        assert tokens == hf_greedy(hf_models["llama"], ids, 6)
        await until_empty(mesh)


async def test_an_ill_formed_relay_message_gets_a_clear_status_and_costs_only_its_session(tiny_model, hf_models):
    ids = prompt(9, seed=7)
    async with one_chain(tiny_model, 2) as (mesh, chain):
        async with (ChainSession(chain, 64, "victim") as victim,
                    ChainSession(chain, 64, "bystander") as bystander):
            tokens = [(await bystander.step(ids, sampling=Sampling())).token_id]
            await victim.step(ids, sampling=Sampling())
            # A faulty upstream (it holds the victim's hop key): hidden states of the wrong width, then an
            # unknown session, in one Relay message; each is answered and the stream goes on.
            bad = [stage_pb2.ForwardRequest(session_id=victim.session_id, start=len(ids) + 1,
                                            hidden=tensor_codec.encode(torch.zeros(1, 3)),
                                            hop_key=victim.hop_keys[1]),
                   stage_pb2.ForwardRequest(session_id="no-such-session", start=0)]
            relayed = mesh.stage_stub(0, 1).Relay(iter([stage_pb2.RelayBatch(steps=bad)]), timeout=10)
            statuses = [s async for s in relayed]
            assert [(s.session_id, s.code) for s in statuses] == [
                (victim.session_id, grpc.StatusCode.INVALID_ARGUMENT.value[0]),
                ("no-such-session", grpc.StatusCode.NOT_FOUND.value[0])]
            assert "hidden states must have shape" in statuses[0].details
            # The victim's router hears it by name; the bystander streams on, exact. (Heard first: a step sent
            # before the notice arrives reaches the last stage through the first, which then reports NOT_FOUND.)
            await until(lambda: not victim.inbox.empty(), 10, "the victim's fault reaches its router")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await victim.step([5], sampling=Sampling())
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert chain.stages[1].address in failed.value.details()
            for _ in range(5):
                tokens.append((await bystander.step(tokens[-1:], sampling=Sampling())).token_id)
        assert tokens == hf_greedy(hf_models["llama"], ids, 6)
        await until_empty(mesh)


async def test_a_dead_next_stage_fails_the_sessions_it_carried_naming_it(tiny_model):
    """The second of three stages stops (its port closes): the router hears UNAVAILABLE naming it, and
    no stage keeps a session."""
    async with one_chain(tiny_model, 3) as (mesh, chain):
        async with ChainSession(chain, 64, "doomed") as session:
            token = (await session.step(prompt(9, seed=8), sampling=Sampling())).token_id
            await mesh.stages[0][1].stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                for _ in range(3):
                    token = (await session.step([token], sampling=Sampling())).token_id
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert mesh.stages[0][1].address in failed.value.details()
        await until_empty(mesh)


async def test_a_stage_stopped_while_the_router_writes_to_it_is_unavailable(tiny_model):
    """The first stage stops while the router is still writing chunks of eight sessions' prefills to it. grpc's
    client then fails its own write with INTERNAL "Internal error from Core" (the call broke under it) and
    the call takes that status; the router hears what it is, the stage gone: UNAVAILABLE naming the stage
    (a stage fault, which repair.py repairs and generation.py blames on the chain), never INTERNAL (which
    would say a step failed alone there)."""
    async with one_chain(tiny_model, 2) as (mesh, chain):
        async with contextlib.AsyncExitStack() as stack:
            sessions = [await stack.enter_async_context(ChainSession(chain, 256, f"stopped-{i}")) for i in range(8)]
            stopped = asyncio.ensure_future(mesh.stages[0][0].stop(0))
            steps = [asyncio.ensure_future(s.step(prompt(192, seed=i), sampling=Sampling(), chunk_size=8))
                     for i, s in enumerate(sessions)]
            failures = await asyncio.gather(*steps, return_exceptions=True)
            await stopped
        assert all(isinstance(f, grpc.aio.AioRpcError) for f in failures), failures
        assert {f.code() for f in failures} == {grpc.StatusCode.UNAVAILABLE}, [f.details() for f in failures]
        assert all(mesh.stages[0][0].address in f.details() for f in failures), [f.details() for f in failures]
        await until_empty(mesh)


async def test_sessions_ended_mid_send_leave_the_link_they_shared_up(tiny_model, hf_models):
    """Issue 12's mid-roll failure. Sessions whose router ends their streams (done, failover, caller gone)
    while their stage is still writing a step onto the Relay link to the next stage: the write was
    cancelled with the session's task, and grpc.aio cancels the whole call when a write is cancelled, so
    every other session on that link failed too, between two healthy stages. Here the link to the next
    stage is held (a black hole) with more hidden states on it than HTTP/2's windows let through (4 prefills
    of 1.8 MB): when the sessions end, one of them is mid-write."""
    ids, victims_n, long = prompt(9, seed=9), 4, prompt(1800, seed=10)
    # Passes (and so messages) that take a 1,800-token prefill as one step: a CPU stage's default budget is 256.
    async with one_chain(tiny_model, 2, batcher=BatcherConfig(max_batch_tokens=2048)) as (mesh, chain):
        with LinkProxy(chain.stages[1].address) as link:
            held = Chain([StageEndpoint(chain.stages[0].address), StageEndpoint(link.address)])
            victims = [ChainSession(held, 2048, f"victim-{i}") for i in range(victims_n)]
            try:
                async with ChainSession(held, 64, "bystander") as bystander:
                    for victim in victims:
                        await victim.__aenter__()
                    tokens = [(await bystander.step(ids, sampling=Sampling())).token_id]
                    before = link.bytes_in
                    link.set(black_hole=True)
                    steps = [asyncio.create_task(v.step(long, sampling=Sampling())) for v in victims]
                    first = mesh.stages[0][0].sessions
                    seen = -1
                    for _ in range(3000):  # until the first stage has run every prefill and its writes stall
                        ran = all(first.sessions[v.session_id].cache.length == len(long) for v in victims)
                        if ran and link.bytes_in == seen:
                            break
                        seen = link.bytes_in
                        await asyncio.sleep(0.2 if ran else 0.01)
                    assert 0 < link.bytes_in - before < victims_n * len(long) * 256 * 4, "nothing held mid-write"
                    for step in steps:
                        step.cancel()
                    for victim in victims:
                        await victim.close()  # their streams end: the first stage ends their sessions there
                    for _ in range(500):
                        if not any(v.session_id in first.sessions for v in victims):
                            break
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.1)  # a session's task is cancelled right after its session closes
                    link.set()
                    for _ in range(5):
                        tokens.append((await bystander.step(tokens[-1:], sampling=Sampling())).token_id)
            finally:
                for victim in victims:
                    await victim.close()
                for stage in held.stages:
                    await stage.close()
        assert tokens == hf_greedy(hf_models["llama"], ids, 6)
        await until_empty(mesh)


@pytest.fixture(scope="module")
def pm3(tiny_model, tmp_path_factory):
    """Two chains of three stage processes, each stage behind a link proxy that the router and the
    previous stage both dial: a fault of the link is a fault of the forwarding link too."""
    mesh = FaultMesh(str(tiny_model), tmp_path_factory.mktemp("fwd-fault-logs"), stages=3, num_layers=8,
                     stage_args=("--kv-cache-gb", "0.02", "--stall-timeout-s", "5", "--drain-timeout-s", "1"),
                     router_args=("--health-interval-s", "0.2", "--step-timeout-s", "2",
                                  "--max-full-wait-s", "5"))
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("fault", ["sigkill", "sigstop", "cut"])
async def test_a_middle_stage_fault_mid_stream_finishes_exact_on_the_other_chain(pm3, expected, fault):
    await _fault(pm3, expected, fault, 1)
