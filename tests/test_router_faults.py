"""The router under faults that are not a clean death: a hung or black-holed stage, a full KV pool,
statuses that blame the session and not the chain, a bad request id, a slow first health check."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from stagemesh import grpc_server, metrics
from stagemesh.errors import StatusError
from stagemesh.router.chain_client import Progress
from stagemesh.router.chain_probe import ChainProbeConfig
from stagemesh.router.generation import Backoff, GenerationConfig
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.stage_server.engine.kv_pool import PoolExhausted
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.server import SERVICE_NAME as STAGE_SERVICE
from stagemesh.stage_server.service.sessions import UnknownSession
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.harness.fault_mesh import free_ports
from tests.harness.link_proxy import LinkProxy
from tests.test_exactness import prompt
from tests.test_traffic import request


async def router_over(mesh, model, chain_specs: list[str], probe: ChainProbeConfig | None = None,
                      **generation) -> router_pb2_grpc.RouterStub:
    """A router for the given chain specs (addresses may be link proxies in front of stages)."""
    mesh.router = RouterServer(RouterConfig(model=str(model), chains=chain_specs, port=0, health_interval_s=0.2,
                                            probe=probe or ChainProbeConfig(),
                                            generation=GenerationConfig(**generation)))
    await mesh.router.start()
    return mesh.router_stub


@pytest.mark.parametrize("fault", ["black_hole", "stalled_compute"])
async def test_a_hung_stage_is_failed_over_like_a_dead_one(tiny_model, hf_models, fault, monkeypatch):
    """A stage that stops answering mid-stream, with its process (and health endpoint) still up:
    the stream moves to the other chain within the progress timeout (one failover, counted) and its tokens
    are exact. The stalled compute is stalled where every pass of the stage runs, its model's forward: the
    queue's path, a lone session's inline step (run_now) and a batch alike. Its stages run torch on two
    threads, so that each pass runs on the stage's compute thread: a one-thread stage runs a lone session's
    decode step inline, on its event loop, which here is the router's and this test's too (a stage stalled
    there answers nothing at all: the black hole)."""
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(2, 6)], router=False, stage_options={"threads": 2})
    hung = mesh.stages[0][1]
    link = LinkProxy(hung.address).start()
    stalled, release = threading.Event(), threading.Event()
    forward = hung.batcher.model.forward

    def stalled_forward(inputs, steps):
        stalled.set()
        release.wait(120)  # the compute thread stuck (bounded: released when the test ends)
        return forward(inputs, steps)

    failovers = metrics.FAILOVERS._value.get()
    try:
        stub = await router_over(mesh, tiny_model, [f"{mesh.stages[0][0].address},{link.address}",
                                                    ",".join(s.address for s in mesh.stages[1])],
                                 step_timeout_s=1.0)
        ids = prompt(16, seed=21)
        expected = hf_greedy(hf_models["llama"], ids, 30)
        mesh.router.chains.chains[1].healthy = False  # the stream starts on the chain behind the link
        got, t_fault, t_next = [], 0.0, 0.0
        async for r in stub.Generate(request(ids, 30), timeout=60):
            got.extend(r.token_ids)
            if len(got) == 5:
                mesh.router.chains.chains[1].healthy = True
                if fault == "black_hole":
                    link.set(black_hole=True)
                else:  # the compute thread stuck: the stage's event loop, and its health, still answer
                    monkeypatch.setattr(hung.batcher.model, "forward", stalled_forward)
                t_fault = time.monotonic()
            elif len(got) == 6:
                t_next = time.monotonic()
        assert got == expected
        assert metrics.FAILOVERS._value.get() - failovers == 1, "the stream left the hung stage's chain, once"
        if fault == "stalled_compute":
            assert stalled.is_set(), "the stage's next pass ran into the stall"
            async with grpc_server.insecure_channel(hung.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, "hung, not dead: its health answers"
        assert t_next - t_fault < 15  # the progress timeout (1 s + margin), not the call's 60 s deadline
    finally:
        release.set()
        link.stop()
        await mesh.stop()


async def test_a_session_waiting_upstream_for_its_first_step_is_not_expired_downstream(tiny_model, hf_models,
                                                                                       monkeypatch):
    """The first stage holds every session's first step back for 1.5 s, as a queue of long prompts ahead of
    it does under load, longer than the stages' unstepped-session timeout (0.3 s here, 30 s by default). The
    last stage's session is in use all along (its router holds it and will step it), so it must wait, not
    expire: the stream's tokens are exact, on its one chain, with no failover."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False,
                            stage_options={"unstepped_session_timeout_s": 0.3})
    first, last = mesh.stages[0]
    submit, held = first.batcher.submit, []

    async def first_steps_held_up(req):
        if req.start == 0:
            held.append(req.session.session_id)
            await asyncio.sleep(1.5)
        return await submit(req)

    monkeypatch.setattr(first.batcher, "submit", first_steps_held_up)
    failovers = REGISTRY.get_sample_value("stagemesh_router_failovers_total") or 0.0
    try:
        # No end-to-end probes: their first steps would be held 1.5 s too, which the stage does not report, and a
        # probe would rightly find the chain not answering in time (tests/test_chain_health.py covers probes).
        stub = await router_over(mesh, tiny_model, [f"{first.address},{last.address}"], step_timeout_s=30.0,
                                 probe=ChainProbeConfig(probe_interval_s=0))
        ids = prompt(16, seed=33)
        got, _, _ = await collect(stub.Generate(request(ids, 12), timeout=60))
        assert got == hf_greedy(hf_models["llama"], ids, 12)
        assert len(held) == 1, "the first step was held up once: the stream was never replayed"
        assert (REGISTRY.get_sample_value("stagemesh_router_failovers_total") or 0.0) == failovers
        deadline = time.monotonic() + 30
        while (len(first.sessions) or len(last.sessions)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(first.sessions) == len(last.sessions) == 0, "every session closed once the stream ended"
    finally:
        await mesh.stop()


async def test_a_full_pool_waits_with_backoff_then_refuses_clearly(tiny_model):
    """No hot retry loop: a request no chain has room for waits (a bounded number of attempts,
    backing off) and ends RESOURCE_EXHAUSTED; once room appears, the next one is served."""
    mesh = await start_mesh(tiny_model, [splits(8)], stage_options={"kv_cache_gb": 0.0005},
                            router_options={"generation": GenerationConfig(max_full_wait_s=1.5)})
    try:
        stage = mesh.stages[0][0]
        holders = []  # sessions that reserve the whole pool (each its look-ahead), never stepped
        while len(holders) <= stage.pool.usable_blocks:
            try:
                holders.append(stage.sessions.open(f"holder{len(holders)}", 16))  # 1 block each
            except PoolExhausted:
                break
        opens_before = _open_calls(stage)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mesh.router_stub.Generate(request([5, 6, 7], 20), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "room" in err.value.details()
        assert 1.0 <= time.monotonic() - t0 < 10
        assert _open_calls(stage) - opens_before < 25  # backing off, not spinning
        for holder in holders:
            stage.sessions.close(holder.session_id)
        ids, _, _ = await collect(mesh.router_stub.Generate(request([5, 6, 7], 20), timeout=30))
        assert len(ids) == 20
    finally:
        await mesh.stop()


async def test_a_full_wait_lasts_max_full_wait_s_whatever_the_jitter():
    """The waits add up to max_full_wait_s (the last one cut short), not a jittered delay less: the
    request above used to give up after as little as 0.4 s of its 1.5."""
    for seed in range(8):
        random.seed(seed)
        backoff = Backoff(None, 0.3)
        with pytest.raises(StatusError) as err:
            for _ in range(100):
                await backoff.wait("full")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert backoff.waited == pytest.approx(0.3), seed


def _open_calls(stage) -> int:
    return stage.sessions.open_attempts


async def test_session_faults_move_the_stream_without_marking_the_chain_down(tiny_model, hf_models, monkeypatch):
    """NOT_FOUND, ALREADY_EXISTS or FAILED_PRECONDITION from a stage is this session's
    trouble: the stream is replayed elsewhere (exact), and the chain stays usable."""
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(4, 4)])
    try:
        ids = prompt(10, seed=5)
        expected = hf_greedy(hf_models["llama"], ids, 12)
        stub = mesh.router_stub
        real_open = mesh.stages[0][1].sessions.open
        failed = []

        def open_once_lost(session_id, *args, **kwargs):
            if not failed:
                failed.append(session_id)
                raise UnknownSession("lost")
            return real_open(session_id, *args, **kwargs)

        mesh.router.chains.chains[1].healthy = False  # start on chain 0, whose stage 1 loses the session
        monkeypatch.setattr(mesh.stages[0][1].sessions, "open", open_once_lost)
        got, _, _ = await collect(stub.Generate(request(ids, 12), timeout=60))
        assert failed and got == expected
        assert mesh.router.chains.chains[0].healthy
    finally:
        await mesh.stop()


@pytest.mark.parametrize("request_id", ["line\nbreak", "caf\u00e9", "x" * 16384, "has space"])
async def test_a_bad_request_id_is_refused_at_once_by_name(tiny_model, request_id):
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        stub = mesh.router_stub
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request([5, 6], 3, request_id=request_id), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
        assert time.monotonic() - t0 < 10
        batch = router_pb2.GenerateBatchRequest(requests=[request([5, 6], 3, request_id=request_id),
                                                          request([5, 6], 3, request_id="fine-1")])
        entries = [item async for item in stub.GenerateBatch(batch, timeout=30)]
        errors = {e.index: e for e in entries if e.error_code}
        assert set(errors) == {0} and errors[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert sum(len(e.response.token_ids) for e in entries if e.index == 1) == 3
    finally:
        await mesh.stop()


async def test_front_door_bounds_on_stop_strings_batch_size_and_prompt_text(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        stub = mesh.router_stub
        for stop in (["x"] * 17, ["y" * 257], [""]):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(request([5, 6], 3, stop=stop), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.GenerateBatch(router_pb2.GenerateBatchRequest(
                requests=[request([5], 1)] * 257), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requests" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(router_pb2.GenerateRequest(prompt="ab" * 100_000, max_new_tokens=1),
                                        timeout=30))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "characters" in err.value.details()
    finally:
        await mesh.stop()


async def test_a_router_is_not_serving_until_a_first_check_finds_a_whole_chain(tiny_model):
    """Its first chain check is slow (the stage's link black-holed): health says NOT_SERVING all along."""
    mesh = await start_mesh(tiny_model, [splits(8)], router=False)
    link = LinkProxy(mesh.stages[0][0].address).start()
    link.set(black_hole=True)
    try:
        mesh.router = RouterServer(RouterConfig(model=str(tiny_model), chains=[link.address], port=0,
                                                health_interval_s=0.2))
        starting = asyncio.ensure_future(mesh.router.start())
        statuses = []
        async with grpc_server.insecure_channel(mesh.router.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not starting.done():
                try:
                    statuses.append((await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status)
                except grpc.aio.AioRpcError:
                    pass  # not listening yet
                await asyncio.sleep(0.05)
            await starting
            statuses.append((await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status)
        assert statuses and health_pb2.HealthCheckResponse.SERVING not in statuses
    finally:
        link.stop()
        await mesh.stop()


async def test_failover_does_not_wait_on_the_dead_chain(tiny_model, hf_models):
    """The chain's stage is black-holed: the stream moves on after the progress timeout, without a
    further wait for CloseSession calls to the dead stage."""
    mesh = await start_mesh(tiny_model, [splits(8), splits(8)], router=False)
    link = LinkProxy(mesh.stages[0][0].address).start()
    try:
        stub = await router_over(mesh, tiny_model, [link.address, mesh.stages[1][0].address], step_timeout_s=1.0)
        ids = prompt(8, seed=8)
        mesh.router.chains.chains[1].healthy = False
        got, gaps, last = [], [], time.monotonic()
        async for r in stub.Generate(request(ids, 10), timeout=60):
            got.extend(r.token_ids)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if len(got) == 3:
                mesh.router.chains.chains[1].healthy = True
                link.set(black_hole=True)
        assert got == hf_greedy(hf_models["llama"], ids, 10)
        timeout = Progress(floor_s=1.0).timeout(mesh.router.chains.chains[0], 1)  # as the router reckons it
        assert max(gaps[3:]) < timeout + 1.5  # the progress timeout, and not 2 s more per CloseSession
    finally:
        link.stop()
        await mesh.stop()


async def test_stage_info_reports_its_progress_inputs(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        await collect(mesh.router_stub.Generate(request([5, 6, 7], 5), timeout=30))
        info = await mesh.stage_stub(0, 0).Info(stage_pb2.InfoRequest())
        assert info.step_ms > 0
        assert info.pass_ms >= info.step_ms  # the prompt's pass, the longest
    finally:
        await mesh.stop()


async def test_a_long_prompt_is_not_starved_by_decodes_whatever_the_chunk_setting(tiny_model, hf_models):
    """The router's chunk (0: whole prompts) is held to the stages' pass budget when it adopts a chain,
    and a chunk left out of passes ages until it runs: a 300-token prompt completes, exactly, while
    eight decode streams keep the stage busy."""
    mesh = await start_mesh(tiny_model, [splits(3, 5)],
                            stage_options={"batcher": BatcherConfig(max_batch_tokens=64)},
                            router_options={"generation": GenerationConfig(prefill_chunk=0)})
    try:
        assert mesh.router.chains.chains[0].max_batch_tokens == 64
        stub = mesh.router_stub
        decoders = [collect(stub.Generate(request(prompt(4, seed=50 + i), 40), timeout=120)) for i in range(8)]
        long_ids = prompt(300, seed=77)
        results = await asyncio.gather(collect(stub.Generate(request(long_ids, 6), timeout=120)), *decoders)
        assert results[0][0] == hf_greedy(hf_models["llama"], long_ids, 6)
        info = await mesh.stage_stub(0, 0).Info(stage_pb2.InfoRequest())
        assert info.max_batch_tokens == 64
    finally:
        await mesh.stop()


async def a_stream_with_two_long_prompts_in_its_way(stub, hf_model, seed: int) -> None:
    """A stream decodes; after its third token two callers' 200-token prompts land in its way. It ends exact,
    and no step of anyone's was timed out."""
    timeouts = metrics.STEP_TIMEOUTS._value.get()
    ids, got, others = prompt(8, seed=seed), [], []
    async for r in stub.Generate(request(ids, 30), timeout=120):
        got.extend(r.token_ids)
        if len(got) == 3:
            others = [asyncio.create_task(collect(stub.Generate(request(prompt(200, seed=seed + 1 + i), 2),
                                                                timeout=120))) for i in range(2)]
    await asyncio.gather(*others)
    assert got == hf_greedy(hf_model, ids, 30)
    assert metrics.STEP_TIMEOUTS._value.get() == timeouts


async def test_a_fresh_chains_first_long_prefill_is_waited_out_not_timed_out(tiny_model, hf_models, monkeypatch):
    """Before any caller's long pass, the stages already tell the router how long one may take: the warm-up
    times a prefill pass and scales it to a full one (--max-batch-tokens). Here a pass of more than 32 tokens
    takes 1 s, on a 0.3 s progress floor; the first long prompts a fresh chain sees land in a decoding
    stream's way, and the stream goes on, exact (before, it was timed out and the chain taken down)."""
    forward = StageModel.forward

    def slow_prefill(self, inputs, steps):
        if inputs.shape[0] > 32:
            time.sleep(1.0)
        return forward(self, inputs, steps)

    monkeypatch.setattr(StageModel, "forward", slow_prefill)
    mesh = await start_mesh(tiny_model, [splits(4, 4)],
                            router_options={"generation": GenerationConfig(step_timeout_s=0.3)})
    try:
        stub, chain = mesh.router_stub, mesh.router.chains.chains[0]
        for _ in range(100):  # the first health checks bring the stages' Info
            if chain.pass_ms:
                break
            await asyncio.sleep(0.1)
        assert chain.pass_ms >= 2 * 1000, "each stage's warm-up saw a pass of 1 s at least"
        await a_stream_with_two_long_prompts_in_its_way(stub, hf_models["llama"], seed=81)
        assert chain.healthy
    finally:
        await mesh.stop()


async def test_a_step_behind_another_callers_long_prefill_is_slow_not_hung(tiny_model, hf_models, monkeypatch):
    """A prefill chunk's pass takes many decode steps' time (here made 1 s, on a 0.3 s progress floor). A stream
    whose step waits one out, and rides in the next, is slow, not hung: the router counts its stages' longest
    recent passes into the progress timeout, and the stream goes on, exact, on its chain (before, every stream
    behind 32 callers' prompts on a ~270M chain was timed out, and the chain taken down)."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)],
                            router_options={"generation": GenerationConfig(step_timeout_s=0.3)})
    try:
        model = mesh.stages[0][0].batcher.model
        forward = model.forward

        def slow_prefill(inputs, steps):
            if inputs.shape[0] > 32:
                time.sleep(1.0)
            return forward(inputs, steps)

        monkeypatch.setattr(model, "forward", slow_prefill)
        stub, chain = mesh.router_stub, mesh.router.chains.chains[0]
        # One long prompt first, straight to the chain's stages (no router's timeout on it): its pass is seen.
        async with ChainSession(chain, 256, "first-long-prompt", progress=Progress(floor_s=60.0)) as session:
            await session.step(prompt(200, seed=90), sampling=Sampling())
        for _ in range(100):
            if chain.pass_ms >= 1000:
                break
            await asyncio.sleep(0.1)
        assert chain.pass_ms >= 1000
        await a_stream_with_two_long_prompts_in_its_way(stub, hf_models["llama"], seed=91)
        assert chain.healthy
    finally:
        await mesh.stop()


def batch_tasks() -> list[asyncio.Task]:
    """The router's tasks that run a GenerateBatch's prompts (one each)."""
    return [t for t in asyncio.all_tasks() if "GenerateBatch" in t.get_coro().__qualname__]


def tokens_streamed() -> float:
    return REGISTRY.get_sample_value("stagemesh_router_tokens_total") or 0.0


async def test_a_batch_caller_that_stops_reading_and_leaves_ends_every_prompt_of_it(tiny_model):
    """8 prompts of 400 tokens to a caller that reads nothing: flow control stops the router's writes,
    its queue of entries fills, and every prompt waits to add one; then the caller cancels. Every
    prompt's task ends (none waits forever to announce its end to nobody) and every session closes."""
    mesh = await start_mesh(tiny_model, [splits(8)])
    # No window growth: the caller's 64 KiB window holds ~1,600 entries of the 3,200.
    channel = grpc.aio.insecure_channel(mesh.router.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        batch = router_pb2.GenerateBatchRequest(requests=[request(prompt(8, seed=i), 400) for i in range(8)])
        call = router_pb2_grpc.RouterStub(channel).GenerateBatch(batch, timeout=120)
        last, still = -1.0, 0
        for _ in range(600):  # until no token has come for a second (at most 60 s)
            await asyncio.sleep(0.1)
            still = still + 1 if tokens_streamed() == last and batch_tasks() else 0
            last = tokens_streamed()
            if still >= 10:
                break
        assert still >= 10 and len(batch_tasks()) == 8, "the prompts did not all stop for the caller"
        call.cancel()
        for _ in range(300):
            if not batch_tasks():
                break
            await asyncio.sleep(0.1)
        assert not batch_tasks()
        assert [i.open_sessions for i in await mesh.settled_infos()] == [0]
    finally:
        await channel.close()
        await mesh.stop()


async def test_list_chains_says_why_each_unusable_chain_is_down(tiny_model):
    """Chains that name a dead port, a gRPC server that is no stage, a stage still loading (NOT_SERVING) and
    a half of the model: ListChains says, for each, which stage and why, and nothing for the chain that
    serves; the router logs each reason once."""
    mesh = await start_mesh(tiny_model, [splits(8), splits(4), splits(8)], router=False)
    loading = mesh.stages[2][0]
    await grpc_server.set_serving(loading.health, [STAGE_SERVICE], False)  # as while it loads or drains
    not_a_stage = grpc_server.new_server()
    grpc_server.add_health_and_reflection(not_a_stage, ["elsewhere.v1.Other"])
    not_a_stage_port = grpc_server.bind(not_a_stage, "127.0.0.1", 0)
    await not_a_stage.start()
    [dead_port] = free_ports(1)
    whole, half = mesh.stages[0][0].address, mesh.stages[1][0].address
    specs = {"serves": whole, "dead": f"127.0.0.1:{dead_port}", "not a stage": f"127.0.0.1:{not_a_stage_port}",
             "loading": loading.address, "half": half}
    try:
        mesh.router = RouterServer(RouterConfig(model=str(tiny_model), chains=list(specs.values()), port=0,
                                                health_interval_s=0.2))
        await mesh.router.start()
        stub = mesh.router_stub
        for _ in range(300):  # every chain checked at least once (a dead port can take a connect timeout)
            listed = {c.stages[0].address: c for c in (await stub.ListChains(router_pb2.ListChainsRequest())).chains}
            if all(c.problem for a, c in listed.items() if a != whole) and listed[whole].healthy:
                break
            await asyncio.sleep(0.1)
        problems = {name: listed[address].problem for name, address in specs.items()}
        assert problems["serves"] == "" and listed[whole].healthy
        assert all(specs[name] in problems[name] for name in specs if name != "serves"), problems
        assert "UNAVAILABLE" in problems["dead"]
        assert "stagemesh.v1.Stage" in problems["not a stage"]
        assert "NOT_SERVING" in problems["loading"]
        assert "covers layers 0:4 of 8" in problems["half"]
    finally:
        await not_a_stage.stop(0)
        await mesh.stop()
