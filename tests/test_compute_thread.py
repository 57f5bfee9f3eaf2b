"""A stage's torch work runs on one thread (StageServer.compute): OpenMP keeps a thread team for each thread
that runs parallel work, and libgomp stops spinning between parallel regions once its threads outnumber the
cores, so a second team (the event loop's, or a loader thread's) slowed every pass of a multi-threaded stage."""

from __future__ import annotations

import asyncio
import threading

import torch

from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.stage_server import server as server_module
from stagemesh.stage_server.config import BatcherConfig, StageConfig
from stagemesh.stage_server.engine.batcher import inline_allowed
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.server import StageServer
from tests.conftest import NO_PROBES, Mesh, collect
from tests.test_exactness import prompt
from tests.test_traffic import request


async def test_a_two_thread_stage_loads_warms_up_and_runs_every_pass_on_its_compute_thread(tiny_model, monkeypatch):
    ran_on: dict[str, set[int]] = {"load": set(), "pool": set(), "pass": set()}
    real_load, real_forward, real_pool = server_module.load_stage, StageModel.forward, server_module.KVPool

    def load_stage(*args, **kwargs):
        ran_on["load"].add(threading.get_ident())
        return real_load(*args, **kwargs)

    def forward(self, inputs, steps):  # warm-up passes, prefill and decode steps alike
        ran_on["pass"].add(threading.get_ident())
        return real_forward(self, inputs, steps)

    def kv_pool(*args, **kwargs):  # zeroes its null block: a parallel region on a large pool
        ran_on["pool"].add(threading.get_ident())
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(server_module, "load_stage", load_stage)
    monkeypatch.setattr(server_module, "KVPool", kv_pool)
    monkeypatch.setattr(StageModel, "forward", forward)
    threads_before = torch.get_num_threads()
    mesh = Mesh()
    try:
        server = StageServer(StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, port=0, threads=2,
                                         kv_cache_gb=0.1))
        mesh.stages.append([server])
        await server.start(await server.in_compute(server.load, 0, 8))
        mesh.router = RouterServer(RouterConfig(model=str(tiny_model), chains=[server.address], port=0,
                                                probe=NO_PROBES))
        await mesh.router.start()
        ids, _, _ = await collect(mesh.router_stub.Generate(request([5, 6, 7, 8], 12)))
        assert len(ids) == 12
        compute_thread = server.compute.submit(threading.get_ident).result()
        assert ran_on == {"load": {compute_thread}, "pool": {compute_thread}, "pass": {compute_thread}}
        assert threading.get_ident() != compute_thread  # not the event loop's
        # Torch work that lands on the event loop all the same (an output log's rows, a tensor cast for the
        # wire) runs there on one OpenMP thread, which starts no team; the compute thread keeps its two.
        assert torch.get_num_threads() == 1
        assert server.compute.submit(torch.get_num_threads).result() == 2
        assert not server.batcher.may_inline  # a lone decode step is not run on the event loop's one thread
    finally:
        await mesh.stop()
        torch.set_num_threads(threads_before)


async def test_a_stage_serving_one_session_decodes_on_its_lone_session_threads(tiny_model, monkeypatch):
    """--lone-session-threads: while a 1-thread stage serves one session (the other stages of its chain wait on
    it, their cores idle) its decode passes run on 2 threads; with two sessions on 1, as do prompts. The tokens are
    the same either way, and the event loop's thread keeps its one."""
    passes: list[tuple[int, int, int]] = []  # (steps, tokens, torch threads) of each pass
    real_forward = StageModel.forward

    def forward(self, inputs, steps):
        passes.append((len(steps), inputs.shape[0], torch.get_num_threads()))
        return real_forward(self, inputs, steps)

    monkeypatch.setattr(StageModel, "forward", forward)
    threads_before = torch.get_num_threads()
    mesh = Mesh()
    try:
        server = StageServer(StageConfig(
            model=str(tiny_model), port=0, layer_start=0, layer_end=8, threads=1, kv_cache_gb=0.1,
            # inline_max_ms=0: on the compute thread. A 30 ms window: the two sessions' steps meet in one pass (with
            # 2 ms they could alternate, each alone in its pass, the other's step a round trip behind)
            batcher=BatcherConfig(lone_session_threads=2, inline_max_ms=0, batch_window_ms=30)))
        mesh.stages.append([server])
        await server.start(await server.in_compute(server.load, 0, 8))
        mesh.router = RouterServer(RouterConfig(model=str(tiny_model), chains=[server.address], port=0,
                                                probe=NO_PROBES))
        await mesh.router.start()
        first, second = prompt(9, seed=41), prompt(23, seed=42)
        passes.clear()  # the warm-up's
        alone, _, _ = await collect(mesh.router_stub.Generate(request(first, 10)))
        assert {threads for _, tokens, threads in passes if tokens == 1} == {2}  # every decode pass
        assert {threads for _, tokens, threads in passes if tokens > 1} == {1}  # the prompt
        passes.clear()
        together = await asyncio.gather(*(collect(mesh.router_stub.Generate(request(p, 10)))
                                          for p in (first, second)))
        assert together[0][0] == alone
        both = [threads for steps, _, threads in passes if steps == 2]
        assert both and set(both) == {1}
        assert torch.get_num_threads() == 1
    finally:
        await mesh.stop()
        torch.set_num_threads(threads_before)


def test_a_lone_pass_runs_inline_only_on_a_one_thread_cpu_stage():
    """A GPU pass waits for its tokens on the host: on the event loop that wait would hold every session's
    messages; a CPU stage of several threads would run it narrower there."""
    assert inline_allowed("cpu", 1)
    assert not inline_allowed("cpu", 2)
    assert not inline_allowed("cuda", 1) and not inline_allowed("cuda", 16)
