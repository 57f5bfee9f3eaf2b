"""Tensor-parallel stages (`--tp K`): the shards they read, their refusals, and greedy tokens and logits equal to
transformers' on the whole model — alone, inside a pipeline chain, under batching and chunked prefill."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from stagemesh.checkpoint import ModelArgs, read_config
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.config import BatcherConfig, StageConfig
from stagemesh.stage_server.engine import tensor_parallel
from stagemesh.stage_server.engine.tensor_parallel import check_tp, rank_args, shard_of
from stagemesh.stage_server.server import StageServer
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import FAMILIES, NO_PROBES, Mesh, collect, hf_greedy, stepped_logits

LAYOUTS = {  # (layer start, layer end, tp) per stage of the one chain
    "tp2": [(0, 8, 2)],
    "tp2+plain": [(0, 4, 2), (4, 8, 1)],
}
MAX_BATCH_TOKENS = 64
"""Small, so that long prompts are prefilled in chunks, beside other sessions' decode steps."""


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def start_tp_mesh(model, layout: list[tuple[int, int, int]]) -> Mesh:
    servers = [StageServer(StageConfig(model=str(model), port=0, layer_start=start, layer_end=end, kv_cache_gb=0.25,
                                       tp=tp, batcher=BatcherConfig(max_batch_tokens=MAX_BATCH_TOKENS)))
               for start, end, tp in layout]
    mesh = Mesh(stages=[servers])
    try:
        for server, (start, end, _) in zip(servers, layout, strict=True):
            await server.start(await asyncio.to_thread(server.load, start, end))
        mesh.router = RouterServer(RouterConfig(model=str(model), chains=[",".join(s.address for s in servers)],
                                                port=0, health_interval_s=0.2, probe=NO_PROBES))
        await mesh.router.start()
    except BaseException:
        await mesh.stop()  # a grpc.aio server left alive hangs the interpreter's exit, after the last test
        raise
    return mesh


@pytest.fixture(scope="module")
async def meshes(tiny_models):
    started = {}
    try:
        for family in FAMILIES:
            for name, layout in LAYOUTS.items():
                started[family, name] = await start_tp_mesh(tiny_models[family], layout)
        started["llama", "plain+tp4"] = await start_tp_mesh(tiny_models["llama"], [(0, 3, 1), (3, 8, 4)])
        yield started
    finally:
        for mesh in started.values():
            await mesh.stop()


CASES = [(f, name) for f in FAMILIES for name in LAYOUTS] + [("llama", "plain+tp4")]


@pytest.mark.parametrize(("family", "layout"), CASES)
async def test_greedy_tokens_equal_transformers(meshes, hf_models, family, layout):
    ids = prompt(24, seed=3)
    expected = hf_greedy(hf_models[family], ids, 32)
    got, _, _ = await collect(meshes[family, layout].router_stub.Generate(
        router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=32)))
    assert got == expected


@pytest.mark.parametrize(("family", "layout"), CASES)
async def test_last_stage_logits_match_transformers(meshes, hf_models, family, layout):
    ids = prompt(16, seed=11)
    new, got_logits = await stepped_logits([s.address for s in meshes[family, layout].stages[0]], ids, 8,
                                           "tp-logits")
    tokens = ids + new
    with torch.inference_mode():
        ref = hf_models[family](torch.tensor([tokens])).logits[0]  # [len, vocab]
    for k, logits in enumerate(got_logits):
        torch.testing.assert_close(logits, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
async def test_batched_requests_and_chunked_prefill_are_exact(meshes, hf_models, family):
    """Eight sessions at once, two of them with prompts prefilled in chunks of MAX_BATCH_TOKENS beside the
    others' decode steps: each stream equals transformers' alone."""
    prompts = [prompt(8 + 13 * i, seed=200 + i) for i in range(6)] + [prompt(150, seed=300), prompt(230, seed=301)]
    expected = [hf_greedy(hf_models[family], p, 16) for p in prompts]
    for layout in LAYOUTS:
        stub = meshes[family, layout].router_stub
        results = await asyncio.gather(*(
            collect(stub.Generate(router_pb2.GenerateRequest(token_ids=p, max_new_tokens=16))) for p in prompts))
        assert [r[0] for r in results] == expected, layout


async def test_stage_reports_its_tp_width(meshes):
    stage = meshes["llama", "tp2+plain"].stages[0][0]
    info = await meshes["llama", "tp2+plain"].stage_stub(0, 0).Info(stage_pb2.InfoRequest())
    assert info.tp_size == 2
    assert len(stage.model.tp_group.pids) == 1


async def test_a_session_closed_mid_pass_leaves_the_ranks_in_step(tiny_models, hf_models, monkeypatch):
    """A caller's stream ends, and its session closes on the event loop, while the session's step is in a pass on
    the compute thread: the pass keeps the session's blocks until it ends, so rank 0 and the ranks it drives read
    the same block table, and the stage serves the next request exactly. (Its blocks had gone back to the pool
    mid-pass: rank 1 received an empty table and died, or rank 0 failed after its broadcast and the ranks hung out
    of step; test_length_routing's cancelled streams hit it on a loaded machine.)"""
    deaths = []  # a rank's death stops the whole stage process (here: pytest's); recorded instead
    monkeypatch.setattr(tensor_parallel, "_exit_with_stage", deaths.append)
    mesh = await start_tp_mesh(tiny_models["llama"], [(0, 8, 2)])
    try:
        server = mesh.stages[0][0]
        closed = []

        def close_in_pass(model, args):  # runs first in the pass: the close lands after the batcher's grow
            if not closed:
                cache = args[1][0].cache
                closed.extend(s.session_id for s in list(server.sessions.sessions.values()) if s.cache is cache)
                server.sessions.close(closed[0])

        hook = server.model.register_forward_pre_hook(close_in_pass, prepend=True)
        chain = Chain([StageEndpoint(server.address)])
        try:
            async with ChainSession(chain, max_length=64, request_id="closed-mid-pass") as session:
                await asyncio.wait_for(session.step(prompt(20, seed=5), sampling=Sampling()), 60)
        except grpc.aio.AioRpcError:
            pass  # its session is gone: the step may fail, but only it
        finally:
            hook.remove()
            await chain.stages[0].close()
        assert len(closed) == 1
        ids = prompt(12, seed=6)
        got, _, _ = await asyncio.wait_for(collect(mesh.router_stub.Generate(
            router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=8))), 60)
        assert got == hf_greedy(hf_models["llama"], ids, 8)
        assert deaths == [] and all(p.poll() is None for p in server.model.tp_group.ranks)
    finally:
        await mesh.stop()


async def test_a_pass_that_fails_on_rank_0_after_its_broadcast_stops_the_stage(tiny_models, monkeypatch):
    """The other ranks are left in that pass's collectives: the next pass finds the ranks out of step and stops the
    stage as one (as when a rank dies) and fails its step, instead of hanging in a collective."""
    deaths = []
    monkeypatch.setattr(tensor_parallel, "_exit_with_stage", deaths.append)
    mesh = await start_tp_mesh(tiny_models["llama"], [(0, 8, 2)])
    try:
        server = mesh.stages[0][0]
        failed = []

        def fail_once_after_broadcast(model, args):  # runs after the tensor-parallel hook has sent the pass
            if not failed:
                failed.append(True)
                raise RuntimeError("rank 0 only")

        hook = server.model.register_forward_pre_hook(fail_once_after_broadcast)
        chain = Chain([StageEndpoint(server.address)])
        try:
            for ids in (prompt(8, seed=7), prompt(8, seed=8)):
                async with ChainSession(chain, max_length=64, request_id="out-of-step") as session:
                    with pytest.raises(grpc.aio.AioRpcError):
                        await asyncio.wait_for(session.step(ids, sampling=Sampling()), 60)
        finally:
            hook.remove()
            await chain.stages[0].close()
        assert len(deaths) == 1 and "out of step" in deaths[0]
        assert all(p.poll() is not None for p in server.model.tp_group.ranks)
    finally:
        await mesh.stop()


def test_shards_cover_each_tensor_once(tiny_model):
    """Over the ranks, each q/k/v and gate/up part's rows and each o_proj/down_proj's columns are split
    without overlap or gap; everything else is whole on every rank."""
    args = ModelArgs.from_config(read_config(tiny_model))
    for size in (2, 4):
        q_rows = [shard_of("layers.0.self_attn.qkv_proj.weight", 0, args, r, size)[0] for r in range(size)]
        k_rows = [shard_of("layers.0.self_attn.qkv_proj.weight", 1, args, r, size)[0] for r in range(size)]
        down_cols = [shard_of("layers.0.mlp.down_proj.weight", 0, args, r, size)[1] for r in range(size)]
        for parts, total in ((q_rows, args.num_heads * args.head_dim), (k_rows, args.num_kv_heads * args.head_dim),
                             (down_cols, args.intermediate_size)):
            assert [i for s in parts for i in range(s.start, s.stop)] == list(range(total))
        assert shard_of("layers.0.self_attn.o_proj.bias", 0, args, 1, size) is None
        assert shard_of("lm_head.weight", 0, args, 1, size) is None
        local = rank_args(args, size)
        assert (local.num_heads, local.num_kv_heads) == (args.num_heads // size, args.num_kv_heads // size)


def test_tp_that_does_not_divide_the_heads_is_refused(tiny_model):
    args = ModelArgs.from_config(read_config(tiny_model))  # 8 heads, 4 KV heads
    with pytest.raises(ValueError, match=r"attention heads \(8\) and its KV heads \(4\)"):
        check_tp(args, 3)
    with pytest.raises(ValueError, match=r"KV heads \(4\)"):
        StageServer(StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, tp=8, port=0))
    with pytest.raises(ValueError, match="--tp"):
        StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, tp=0)
    with pytest.raises(ValueError, match="--quantize or --compile"):
        StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, tp=2, compile=True)
