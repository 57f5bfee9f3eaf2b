"""One fault at a time on a 2x2 mesh of real processes (two chains of two stages, each stage behind a
link proxy, a router in front) with streams running. For each fault: every stream completes with
exactly the tokens of an undisturbed run (streams on the faulted chain after a failover or repair, which
the router's counters show); no process dies but the one killed; afterwards the mesh is whole again and
no stage holds a session or KV bytes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
import pytest

from stagemesh import grpc_server
from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.chain_table import decode_chains
from stagemesh.discovery.registry import RegistryError, chains_key
from stagemesh.launcher import stage_env, start_local_mesh
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import hf_greedy
from tests.harness.fault_mesh import FaultMesh
from tests.test_exactness import prompt

STREAMS = 4
NEW_TOKENS = 48
DEADLINE_S = 90.0
MOVED = ("stagemesh_router_failovers", "stagemesh_router_repairs")
"""The router's counters of streams that left a failed stage: to another chain, or with the stage replaced."""


@pytest.fixture(scope="module")
def pm(tiny_model, tmp_path_factory):
    mesh = FaultMesh(str(tiny_model), tmp_path_factory.mktemp("fault-logs"), num_layers=8,
                     stage_args=("--kv-cache-gb", "0.02", "--stall-timeout-s", "5", "--drain-timeout-s", "1",
                                 # the full-pool fault's sessions, never stepped, hold the pool all along
                                 "--unstepped-session-timeout-s", "120"),
                     router_args=("--health-interval-s", "0.2", "--step-timeout-s", "2", "--max-full-wait-s", "5"))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def expected(hf_models):
    prompts = [prompt(6 + 5 * i, seed=900 + i) for i in range(STREAMS)]
    return prompts, [hf_greedy(hf_models["llama"], p, NEW_TOKENS) for p in prompts]


async def _healthy_chains(stub) -> int:
    return sum(c.healthy for c in (await stub.ListChains(router_pb2.ListChainsRequest(), timeout=5)).chains)


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.2)


async def _stream(stub, ids: list[int], running: asyncio.Event):
    """The stream's tokens, or (code, details, seconds) if it ended with an error; `running` is set
    once it has its first tokens (or has ended)."""
    t0 = time.monotonic()
    got: list[int] = []
    try:
        async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=NEW_TOKENS),
                                     timeout=DEADLINE_S):
            got.extend(r.token_ids)
            if len(got) >= 3:
                running.set()
        return got
    except grpc.aio.AioRpcError as exc:
        return (exc.code(), exc.details(), time.monotonic() - t0)
    finally:
        running.set()


async def run_fault(pm: FaultMesh, expected, inject, restore=None, *, moves: bool = False) -> list:
    """Starts the streams, injects the fault once every stream has tokens, restores, and checks the
    outcome: every stream exact (a stream that ended with any status fails the test); with `moves`, the
    fault hit a chain carrying streams and the router's counters show they left it (failover or repair),
    without it, that no stream had to. Then the mesh is whole again and every stage empty."""
    prompts, wanted = expected
    moved_before = sum(pm.router_counter(name) for name in MOVED)
    async with grpc_server.insecure_channel(pm.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await _until(lambda: _healthy_chains_is(stub, 2), 30, "both chains healthy before the fault")
        running = [asyncio.Event() for _ in prompts]
        streams = [asyncio.ensure_future(_stream(stub, p, r)) for p, r in zip(prompts, running, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in running)), 60)
        await asyncio.to_thread(inject)
        results = await asyncio.gather(*streams)
        if restore:
            await asyncio.to_thread(restore)
        assert results == wanted
        moved = sum(pm.router_counter(name) for name in MOVED) - moved_before
        assert moved >= 1 if moves else moved == 0, f"{moved} streams left a failed stage"
        await _until(lambda: _healthy_chains_is(stub, 2), 60, "both chains healthy again after the fault")
        ids = [t async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=prompts[0],
                                                                          max_new_tokens=NEW_TOKENS), timeout=60)
               for t in r.token_ids]
        assert ids == wanted[0]
    assert all(pm.alive()), "a process died that was not the one killed"
    await _until(lambda: _all_stages_empty(pm), 20, "every stage back to 0 sessions and 0 KV bytes")
    return results


async def _healthy_chains_is(stub, n: int) -> bool:
    with contextlib.suppress(grpc.aio.AioRpcError):
        return await _healthy_chains(stub) == n
    return False


async def _all_stages_empty(pm: FaultMesh) -> bool:
    return await asyncio.to_thread(pm.open_sessions) == [(0, 0)] * len(pm.ports)


async def _fault(pm: FaultMesh, expected, fault: str, index_in_chain: int, *, moves: bool = True) -> list:
    """The fault on the stage at this position of the chain carrying the most streams."""
    victim = {}

    def inject():
        victim["i"] = pm.busy_stage(index_in_chain)
        pm.inject(fault, victim["i"])

    return await run_fault(pm, expected, inject, lambda: pm.heal(fault, victim["i"]), moves=moves)


async def test_sigkill_a_stage(pm, expected):
    await _fault(pm, expected, "sigkill", 1)


async def test_sigstop_a_stage_then_sigcont(pm, expected):
    await _fault(pm, expected, "sigstop", 0)


async def test_cut_a_link_then_restore_it(pm, expected):
    await _fault(pm, expected, "cut", 1)


async def test_black_hole_a_link_then_restore_it(pm, expected):
    await _fault(pm, expected, "black_hole", 0)


async def test_200ms_one_way_delay_on_a_link(pm, expected):
    """Slow, not dead: every stream completes exactly where it started."""
    await _fault(pm, expected, "delay", 1, moves=False)


async def test_a_full_kv_pool_on_one_stage(pm, expected):
    """Sessions fill a stage's pool (opened directly, never stepped): the streams already there finish, and a
    new request is served exact by the other chain meanwhile."""
    prompts, wanted = expected
    held, served = [], []
    channels = []  # the hog's connection: only the opener of a session may close it

    def fill():
        i = pm.busy_stage(0)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{pm.ports[i]}"))
        stub = stage_pb2_grpc.StageStub(channels[0])
        for n in range(200):
            try:
                stub.OpenSession(stage_pb2.OpenSessionRequest(session_id=f"hog-{n}", max_length=2048), timeout=5)
                held.append(f"hog-{n}")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                break
        with grpc.insecure_channel(pm.router.address) as channel:
            served.extend(t for r in router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(token_ids=prompts[1], max_new_tokens=NEW_TOKENS), timeout=60)
                for t in r.token_ids)

    def release():
        with channels[0]:
            for sid in held:
                stage_pb2_grpc.StageStub(channels[0]).CloseSession(stage_pb2.CloseSessionRequest(session_id=sid),
                                                                   timeout=5)

    await run_fault(pm, expected, fill, release)
    assert len(held) < 200, "the pool never filled"
    assert served == wanted[1]


async def test_garbage_bytes_to_every_port(pm, expected):
    await run_fault(pm, expected, pm.send_garbage)


async def test_a_poisonous_request_among_the_streams(pm, expected):
    """A NaN temperature is refused at the door; a 1e-40 one is served; the streams are untouched."""
    outcome = {}

    def poison():
        with grpc.insecure_channel(pm.router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            try:
                list(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=4,
                                                              temperature=float("nan")), timeout=10))
            except grpc.RpcError as exc:
                outcome["nan"] = exc.code()
            outcome["tiny"] = sum(len(r.token_ids) for r in stub.Generate(router_pb2.GenerateRequest(
                token_ids=[5, 6], max_new_tokens=4, temperature=1e-40, seed=3), timeout=30))

    await run_fault(pm, expected, poison)
    assert outcome == {"nan": grpc.StatusCode.INVALID_ARGUMENT, "tiny": 4}


async def _chain_ids(stub) -> list[tuple[str, bool]]:
    return sorted((c.chain_id, c.healthy) for c in (await stub.ListChains(router_pb2.ListChainsRequest(),
                                                                           timeout=5)).chains)


async def _published_ids(registry_url: str, model_name: str) -> list[str] | None:
    """The chain ids the registry's table names, or None while it holds no table (or cannot be reached)."""
    registry = open_registry(registry_url)
    try:
        raw, _ = await registry.kv_get(chains_key(model_name))
    except RegistryError:
        return None
    finally:
        await registry.close()
    return None if raw is None else sorted(c.chain_id for c in decode_chains(raw))


def _loads(mesh) -> int:
    """How many ranges the stages were told to load, all told (their logs say each)."""
    return sum(p.log_path.read_text().count("assigned layers") for p in mesh.processes if p.name.startswith("stage"))


async def test_kill_the_registry_and_restart_it(tiny_model, expected, tmp_path):
    """The registry (hosted by the scheduler process) is killed mid-stream and restarted on its port, empty:
    streams and routers carry on with the chains they know; stages register again, and the new scheduler
    publishes chains of the stages as they serve. At no moment is the router short of a healthy chain: a
    restarted registry holds no chain table until its scheduler has seen the stages, and no stage is moved."""
    mesh, router = start_local_mesh(str(tiny_model), stages=2, replicas=2, router_port=0, registry="local",
                                    threads=1, log_dir=tmp_path)
    try:
        scheduler = mesh.processes[0]
        registry_port = scheduler.address.rpartition(":")[2]
        prompts, wanted = expected
        async with grpc_server.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await _until(lambda: _healthy_chains_is(stub, 2), 90, "two chains published")
            running = [asyncio.Event() for _ in prompts]
            streams = [asyncio.ensure_future(_stream(stub, p, r)) for p, r in zip(prompts, running, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in running)), 60)
            scheduler.popen.send_signal(signal.SIGKILL)
            scheduler.popen.wait(10)
            assert await asyncio.gather(*streams) == wanted
            ids = [t async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=prompts[1],
                                                                              max_new_tokens=NEW_TOKENS), timeout=60)
                   for t in r.token_ids]
            assert ids == wanted[1]  # served on the last known chains, registry gone
            restarted = await asyncio.to_thread(mesh.spawn, "scheduler-2", [
                "scheduler", "--model", str(tiny_model), "--registry", "local", "--registry-port", registry_port],
                stage_env(1))
            assert restarted.address.endswith(f":{registry_port}")
            loads_before = _loads(mesh)
            seen = []  # what the router lists, every 0.1 s, until the new table has been out for 3 s
            deadline, published, published_at = time.monotonic() + 90, None, None
            while published_at is None or time.monotonic() < published_at + 3:
                assert time.monotonic() < deadline, f"no table of 2 chains published within 90 s: {seen[-1:]}"
                seen.append(await _chain_ids(stub))
                if published_at is None:
                    published = await _published_ids(f"local://127.0.0.1:{registry_port}", tiny_model.name)
                    published_at = time.monotonic() if published and len(published) == 2 else None
                await asyncio.sleep(0.1)
            # The new scheduler cannot know which first half fed which second half (a restarted registry holds
            # no table), so the chains may be paired anew: the router takes them make-before-break.
            assert [s for s in seen if [healthy for _, healthy in s] != [True, True]] == [], \
                "the router was short of a healthy chain through the restart"
            assert seen[-1] == [(i, True) for i in published]
            ids = [t async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=prompts[2],
                                                                              max_new_tokens=NEW_TOKENS), timeout=60)
                   for t in r.token_ids]
            assert ids == wanted[2]
        assert all(p.popen.poll() is None for p in mesh.processes if p is not scheduler)
        assert _loads(mesh) == loads_before, "a stage was given another range after the restart"
    finally:
        mesh.stop()
