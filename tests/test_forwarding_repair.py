"""Repair of a forwarding chain (the router's default data path): when one stage dies mid-stream, another chain's
stage of the same layers takes its place, rebuilt from the previous stage's output log (token ids for a first
stage) while answering on its own stream; every stage is rewound to the position before the failed step, the
one before the new stage re-pointed at it, and the step sent again. Tokens equal transformers', logits within
1e-4, the stages after the new one keep their KV caches, and every session is closed after."""

from __future__ import annotations

import logging

import grpc
import pytest

from stagemesh import metrics, tensor_codec
from stagemesh.router import repair
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.v1 import router_pb2
from tests.conftest import hf_greedy, splits, start_mesh
from tests.test_exactness import prompt
from tests.test_repair import assert_repaired_exactly

LAYOUT = splits(2, 3, 3)


def endpoints(servers) -> list[StageEndpoint]:
    return [StageEndpoint(s.address, a, b) for s, (a, b) in zip(servers, LAYOUT, strict=True)]


@pytest.mark.parametrize("dead", [0, 1, 2])
@pytest.mark.parametrize("failed_at", ["prefill", "decode"])
async def test_a_repaired_forwarding_chain_continues_exact(tiny_model, hf_models, dead, failed_at):
    mesh = await start_mesh(tiny_model, [LAYOUT, LAYOUT], router=False)
    chain, spares = Chain(endpoints(mesh.stages[0])), endpoints(mesh.stages[1])
    try:
        ids = prompt(40, seed=80 + dead)
        tokens, got = list(ids), []
        async with ChainSession(chain, max_length=128, request_id="frepair-test", keep_output=True) as session:
            feed = ids
            for k in range(12):
                if k == (0 if failed_at == "prefill" else 5):
                    after = [mesh.stages[0][j].sessions.sessions[session.session_id].cache for j in range(dead + 1, 3)]
                    await mesh.stages[0][dead].stop(0)
                    with pytest.raises(grpc.aio.AioRpcError) as failed:  # chunks in flight at several stages
                        await session.step(feed, sampling=Sampling(), chunk_size=16, return_logits=True)
                    assert failed.value.code() in repair.REPAIRABLE and session.failed_stage == dead
                    assert repair.possible(session, failed.value) == ""
                    result = await repair.repair(session, spares[dead], tokens, 16, return_logits=True)
                    assert session.session_id in mesh.stages[1][dead].sessions.sessions  # the spare holds it
                    for j, cache in zip(range(dead + 1, 3), after, strict=True):  # the same cache, grown
                        assert mesh.stages[0][j].sessions.sessions[session.session_id].cache is cache
                        assert cache.length == len(tokens)
                else:
                    result = await session.step(feed, sampling=Sampling(), chunk_size=16, return_logits=True)
                got.append(tensor_codec.decode(result.logits))
                tokens.append(result.token_id)
                feed = [result.token_id]
        await assert_repaired_exactly(hf_models["llama"], ids, tokens, got, mesh, dead)
    finally:
        for stage in [*chain.stages, *spares]:
            await stage.close()
        await mesh.stop()


async def test_a_stage_whose_log_was_dropped_is_replayed_exact(tiny_model, hf_models, caplog):
    """Stages whose repair log is too small for the session (--repair-log-tokens 16, a 30-token prompt): each drops
    the session's log at its first step, counted (stagemesh_stage_output_log_dropped_total{reason="full"}) and
    logged; when the middle stage stops, the router's repair finds no log to rebuild from and falls back to a replay
    on the other chain, counted (stagemesh_router_repair_fallbacks_total{reason="log_dropped"}) and logged with the
    request's id; the stream is exact."""
    caplog.set_level(logging.INFO, logger="stagemesh")
    full = metrics.OUTPUT_LOG_DROPPED.labels("full")._value.get()
    fallbacks = metrics.REPAIR_FALLBACKS.labels("log_dropped")._value.get()
    mesh = await start_mesh(tiny_model, [LAYOUT, LAYOUT], stage_options={"repair_log_tokens": 16})
    try:
        assert [s.sessions.log_budget.capacity_tokens for s in mesh.stages[0]] == [16, 16, 0]  # none on a last stage
        assert "repair log: 16 tokens (0 MiB) in host memory, in chunks of 16" in caplog.text  # said once at start
        ids = prompt(30, seed=91)
        call = mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=20,
                                                                    request_id="dropped-log"))
        got = []
        while len(got) < 5:
            got.extend((await call.read()).token_ids)
        chain = next(c for c in mesh.stages if c[1].sessions.sessions)
        assert all(s.output.lost for s in chain[0].sessions.sessions.values())
        await chain[1].stop(0)
        while (response := await call.read()) is not grpc.aio.EOF:
            got.extend(response.token_ids)
        assert got == hf_greedy(hf_models["llama"], ids, 20)
        assert metrics.OUTPUT_LOG_DROPPED.labels("full")._value.get() >= full + 2  # chain A's first two stages
        assert metrics.REPAIR_FALLBACKS.labels("log_dropped")._value.get() == fallbacks + 1
        dropped = [r for r in caplog.records if r.getMessage().startswith("output log dropped (full)")]
        assert dropped and all(r.request_id == "dropped-log" for r in dropped)
        fallback = [r for r in caplog.records if getattr(r, "reason", "") == "log_dropped"]
        assert len(fallback) == 1 and fallback[0].request_id == "dropped-log"
        assert "FAILED_PRECONDITION" in fallback[0].getMessage() and "replaying" in caplog.text
    finally:
        await mesh.stop()
