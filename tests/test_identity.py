"""Safe to expose across hosts: a session is its opener's alone, unstepped sessions do not hold a pool,
messages are bounded by what a step can need, a stage announces where it is reached, and one chain
never mixes two builds of a model (the scheduler plans each build apart, routers refuse mixed chains)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import shutil
import time

import grpc
import pytest
import torch

from stagemesh import grpc_server, tensor_codec, wire
from stagemesh.checkpoint import ModelFootprint, model_fingerprint, serving_fingerprint, weight_files
from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.chain_table import decode_chains
from stagemesh.discovery.registry import assignment_key, chains_key
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.router.session import ChainSession
from stagemesh.scheduler import placement
from stagemesh.scheduler.server import print_plan
from stagemesh.stage_server.config import BatcherConfig, StageConfig, max_step_bytes, split_host_port
from stagemesh.stage_server.server import StageServer
from stagemesh.stage_server.service.registration import Registration, RegistrationConfig
from stagemesh.tiny_model import make_tiny_model
from stagemesh.tls import PlaintextConfig
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from stagemesh.wire import PROTOCOL_VERSION
from tests.conftest import (
    NO_PROBES,
    StageSessions,
    call_status,
    collect,
    hf_greedy,
    splits,
    start_mesh,
    step_error,
    step_status,
)
from tests.test_kv_pool import kv_gb_for_blocks
from tests.test_scheduler import ControlPlane, wait_for_chains


@pytest.fixture(scope="module")
def other_build(tiny_model, tmp_path_factory):
    """The same model name, config, tokenizer and tensor shapes as tiny_model, other weights (another seed)."""
    return make_tiny_model(tmp_path_factory.mktemp("other-build") / tiny_model.name, "llama", layers=8, seed=8)


def other_connection(address: str) -> stage_pb2_grpc.StageStub:
    """A stub on a connection of its own: channels in one process otherwise share a connection per target."""
    channel = grpc.aio.insecure_channel(address, options=[*grpc_server.CHANNEL_OPTIONS,
                                                          ("grpc.use_local_subchannel_pool", 1)])
    return stage_pb2_grpc.StageStub(channel)


def step(session_id: str, ids: list[int], start: int = 0) -> stage_pb2.ForwardRequest:
    return stage_pb2.ForwardRequest(session_id=session_id, start=start, token_ids=wire.encode_ids(ids))


# --- sessions ---------------------------------------------------------------------------------------------


async def test_a_session_is_stepped_and_closed_by_its_opener_only(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)], router=False)
    owner, stranger = mesh.stage_stub(0, 0), other_connection(mesh.stages[0][0].address)
    try:
        await owner.OpenSession(stage_pb2.OpenSessionRequest(session_id="mine", max_length=16))
        for _ in range(2):  # a stranger's failed attempts close nothing either
            assert await step_status(stranger, step("mine", [5, 6])) == grpc.StatusCode.NOT_FOUND
            assert await call_status(stranger.CloseSession(stage_pb2.CloseSessionRequest(session_id="mine"))) == \
                grpc.StatusCode.NOT_FOUND
        # The same answer as for an id that never existed: nothing tells the stranger it is in use.
        theirs = await step_error(stranger, step("mine", [5]))
        never = await step_error(stranger, step("nobody", [5]))
        assert theirs.details().replace("mine", "X") == never.details().replace("nobody", "X")
        assert (await owner.Info(stage_pb2.InfoRequest())).open_sessions == 1
        call = StageSessions(owner)
        await call.send(steps=[step("mine", [5, 6])])
        assert (await call.read())[0].HasField("token_id")  # the opener steps it
        await call.call.done_writing()
        assert await call.call.code() == grpc.StatusCode.OK  # the stream's end closed "mine"
        await owner.OpenSession(stage_pb2.OpenSessionRequest(session_id="closable", max_length=16))
        await owner.CloseSession(stage_pb2.CloseSessionRequest(session_id="closable"))  # and closes it
        assert (await owner.Info(stage_pb2.InfoRequest())).open_sessions == 0
    finally:
        await mesh.stop()


async def test_router_session_ids_are_unguessable(tiny_model):
    chain = Chain([StageEndpoint("127.0.0.1:1")])
    ids = {ChainSession(chain, 8, "req-7").session_id for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) == 32 and int(i, 16) >= 0 and "req-7" not in i for i in ids)  # 128 random bits


async def test_sessions_opened_and_never_stepped_do_not_hold_the_pool(tiny_model):
    # 9 blocks: the worker holds 1 and reserves 4 more, the hog reserves 4 (look-ahead, not max_length).
    mesh = await start_mesh(tiny_model, [splits(8)], router=False,
                            stage_options={"unstepped_session_timeout_s": 0.5, "kv_cache_gb": kv_gb_for_blocks(9)})
    stub = mesh.stage_stub(0, 0)
    try:
        call = StageSessions(stub)  # a session in use: stepped, its stream open
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="worker", max_length=100))
        await call.send(steps=[step("worker", [5, 6])])
        await call.read()
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="hog", max_length=100))
        assert await call_status(stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="late", max_length=100))) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED  # the pool is full
        t0 = time.monotonic()
        while (await stub.Info(stage_pb2.InfoRequest())).open_sessions > 1 and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.05)
        assert time.monotonic() - t0 < 60  # the short timeout (0.5 s), not the 300 s idle one; slow machines too
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="late", max_length=100))  # room again
        await call.send(steps=[step("worker", [7], start=2)])  # the stepped session was left alone
        assert (await call.read())[0].HasField("token_id")
        call.cancel()
    finally:
        await mesh.stop()


# --- message sizes ----------------------------------------------------------------------------------------


async def test_a_message_larger_than_a_step_can_need_is_refused_and_the_stage_serves_on(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(4, 4)], stage_options={"batcher": BatcherConfig(max_batch_tokens=16)})
    stub = mesh.stage_stub(0, 1)
    limit = max_step_bytes(16, 256)
    assert limit < 2 * 2**20 < grpc_server.MAX_MESSAGE_BYTES
    try:
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="big", max_length=2048))
        too_big = stage_pb2.ForwardRequest(session_id="big", start=0,
                                           hidden=tensor_codec.encode(torch.zeros(2048, 256)))  # 2 MiB
        assert too_big.ByteSize() > limit
        assert await step_status(stub, too_big) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A whole pass's worth is accepted, and the stage serves on.
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="fits", max_length=64))
        fits = stage_pb2.ForwardRequest(session_id="fits", start=0, hidden=tensor_codec.encode(torch.zeros(16, 256)))
        call = StageSessions(stub)
        await call.send(steps=[fits])
        [response] = await call.read()
        call.cancel()
        assert response.HasField("token_id")
        ids = [5, 6, 7] * 20  # a 60-token prompt: in chunks of the stages' 16-token pass budget
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=6)))
        assert got == hf_greedy(hf_models["llama"], ids, 6)
    finally:
        await mesh.stop()


# --- addresses --------------------------------------------------------------------------------------------


def test_a_wildcard_bind_needs_advertise_by_name(tiny_model):
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match=f"--host {wildcard}: .*--advertise HOST"):
            StageConfig(model=str(tiny_model), layer_start=0, host=wildcard)
    for bad in ("0.0.0.0:50061", "[::]", "host:0", "host:http", "[::1"):
        with pytest.raises(ValueError, match="--advertise"):
            StageConfig(model=str(tiny_model), layer_start=0, advertise=bad)
    assert StageConfig(model=str(tiny_model), layer_start=0, host="0.0.0.0", advertise="10.1.2.3",
                       plaintext=PlaintextConfig(insecure=True)).advertise


async def test_the_registry_holds_the_advertised_address_and_ids_are_unique_per_start(tiny_model):
    assert split_host_port("stage-7.example:6000") == ("stage-7.example", 6000)
    assert split_host_port("[fd00::7]:6000") == ("fd00::7", 6000) and split_host_port("fd00::7") == ("fd00::7", None)
    plane = await ControlPlane(tiny_model).start()
    servers = []
    try:
        registry = open_registry(plane.url)
        plane.closers.append(registry.close)
        # Two processes announcing one address (a misconfiguration; or a restart, before the old
        # registration expires): two registrations, neither overwrites the other.
        for advertise in ("127.0.0.1", "127.0.0.1:{port}"):
            port = servers[0].port if servers else 0
            server = StageServer(StageConfig(model=str(tiny_model), host="0.0.0.0", port=0, layer_start=0, layer_end=8,
                                             advertise=advertise.format(port=port), kv_cache_gb=0.1,
                                             plaintext=PlaintextConfig(insecure=True)))
            await server.start(server.load(0, 8))
            servers.append(server)
            registration = Registration(server, registry, RegistrationConfig(tiny_model.name, 2**30, ttl_s=1.0),
                                        fixed=True)
            await registration.start()
            plane.stages.append((server, registration))
        port = servers[0].port
        assert servers[0].address == servers[1].address == f"127.0.0.1:{port}"
        assert servers[0].bind_address == f"0.0.0.0:{port}"
        deadline = time.monotonic() + 10
        while len(records := await registry.services(tiny_model.name)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert [r.record.address for r in records] == [f"127.0.0.1:{port}"] * 2
        ids = [r.record.service_id for r in records]
        assert len(set(ids)) == 2 and all(i.startswith(f"stage-127.0.0.1-{port}-") for i in ids)
        assert {r.record.meta["fingerprint"] for r in records} == {servers[0].fingerprint}
        info = await stage_pb2_grpc.StageStub(grpc_server.insecure_channel(servers[0].address)).Info(
            stage_pb2.InfoRequest())  # reachable where it says it is
        assert info.fingerprint == servers[0].fingerprint
    finally:
        await plane.stop()


# --- model identity ---------------------------------------------------------------------------------------


def test_the_model_digest_follows_the_content_not_the_place(tiny_model, other_build, tmp_path):
    digest = model_fingerprint(tiny_model)
    copy = shutil.copytree(tiny_model, tmp_path / "elsewhere")
    assert model_fingerprint(copy) == digest
    assert model_fingerprint(other_build) != digest  # same shapes and headers, other weights
    [path] = set(weight_files(copy).values())
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + header_size])["model.layers.5.mlp.down_proj.weight"]["data_offsets"]
    data[8 + header_size + (begin + end) // 2] ^= 0x01  # one bit of one weight, mid-tensor (a probe)
    path.write_bytes(bytes(data))
    assert model_fingerprint(copy) != digest
    shutil.rmtree(copy)
    copy = shutil.copytree(tiny_model, tmp_path / "retokenized")
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    assert model_fingerprint(copy) != digest
    assert serving_fingerprint(digest, "float32", "none") == f"{digest[:16]}/float32/none/p{PROTOCOL_VERSION}"


def test_placement_plans_each_build_apart():
    model = ModelFootprint(num_layers=8, layer_bytes=100, embed_bytes=100, head_bytes=100,
                           kv_bytes_per_token_per_layer=0)
    half = int(model.total_bytes * 0.6 / 0.8)
    hosts = [placement.Host(f"h{i}", half, fingerprint="aaaa/float32/none" if i % 2 else "bbbb/float32/none")
             for i in range(4)]
    plan = placement.plan(model, hosts)
    builds = {h.host_id: h.fingerprint for h in hosts}
    assert len(plan.chains) == 2
    for chain in plan.chains:
        assert len(chain.stages) == 2 and {builds[h] for h in chain.host_ids} == {chain.fingerprint}
    assert "2 builds of the model" in plan.explanation and "planned on their own" in plan.explanation
    # A host that went to the other build leaves its chain: the kept chains stay single-build.
    moved = [placement.Host("h1", half, fingerprint="bbbb/float32/none"), *[h for h in hosts if h.host_id != "h1"]]
    again = placement.plan(model, moved, previous=plan)
    builds = {h.host_id: h.fingerprint for h in moved}
    assert all({builds[h] for h in c.host_ids} == {c.fingerprint} for c in again.chains)
    assert len(again.chains) == 1 and again.chains[0].fingerprint == "bbbb/float32/none"


async def test_the_scheduler_never_chains_two_builds_and_routers_use_their_own(tiny_model, other_build, hf_models):
    plane = await ControlPlane(tiny_model).start()
    try:
        await plane.add_scheduler()
        servers = [await plane.add_stage(share_of_model=0.6, model=m)
                   for m in (tiny_model, other_build, tiny_model, other_build)]  # 2 stages per chain
        fingerprint = {s.address: s.fingerprint for s in servers}
        assert len(set(fingerprint.values())) == 2
        stub = await plane.add_router()
        registry = open_registry(plane.url)
        plane.closers.append(registry.close)
        deadline = time.monotonic() + 30
        while len(published := decode_chains((await registry.kv_get(chains_key(tiny_model.name)))[0])) < 2:
            assert time.monotonic() < deadline, published
            await asyncio.sleep(0.1)
        assert len(published) == 2
        for chain in published:
            assert len(chain.stages) == 2
            assert {fingerprint[s.address] for s in chain.stages} == {chain.fingerprint}  # never mixed
        assert {c.fingerprint for c in published} == set(fingerprint.values())
        # The router serves on its own build's chain only, and ListChains says which is which.
        [usable] = await wait_for_chains(stub, lambda c: len(c) == 1)
        assert usable.fingerprint == servers[0].fingerprint
        while len((listing := await stub.ListChains(router_pb2.ListChainsRequest())).chains) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert sorted(c.fingerprint for c in listing.chains) == sorted(set(fingerprint.values()))
        assert [c.healthy for c in listing.chains if c.fingerprint != usable.fingerprint] == [False]
        assert "2 builds of the model" in listing.plan
        ids = [9, 8, 7, 6]
        got, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=5)))
        assert got == hf_greedy(hf_models["llama"], ids, 5)
        printed = await print_plan(plane.url, tiny_model.name)
        assert all(fp in printed for fp in fingerprint.values())
    finally:
        await plane.stop()


async def test_router_refuses_a_static_chain_that_mixes_builds_or_serves_another_model(
        tiny_model, other_build, hf_models, caplog, tmp_path):
    ours, theirs = [], []
    try:
        for model, servers in ((tiny_model, ours), (other_build, theirs)):
            for a, b in splits(4, 4):
                server = StageServer(StageConfig(model=str(model), port=0, layer_start=a, layer_end=b, kv_cache_gb=0.1))
                await server.start(server.load(a, b))
                servers.append(server)
        specs = [f"{ours[0].address},{theirs[1].address}",  # mixed
                 f"{theirs[0].address},{theirs[1].address}",  # one build, not the router's model
                 f"{ours[0].address},{ours[1].address}"]
        router = RouterServer(RouterConfig(model=str(tiny_model), chains=specs, port=0, health_interval_s=0.1))
        with caplog.at_level(logging.ERROR, logger="stagemesh.router"):
            await router.start()
            await asyncio.sleep(0.6)  # several health checks
            chains = router.chains.chains
            assert [c.healthy for c in chains] == [False, False, True]
            assert chains[0].fingerprint == f"{ours[0].fingerprint}, {theirs[1].fingerprint}"
            assert chains[1].fingerprint == theirs[0].fingerprint != ours[0].fingerprint
            channel = grpc_server.insecure_channel(router.address)
            stub = router_pb2_grpc.RouterStub(channel)
            listing = await stub.ListChains(router_pb2.ListChainsRequest())
            assert [c.fingerprint for c in listing.chains] == [c.fingerprint for c in chains]
            assert "mixes builds" in listing.chains[0].problem and "not this router's" in listing.chains[1].problem
            assert listing.chains[2].problem == ""
            ids = [4, 5, 6]
            got, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=4)))
            assert got == hf_greedy(hf_models["llama"], ids, 4)
            await channel.close()
            await router.stop(0)
        mixed = [r for r in caplog.records if "mixes builds" in r.getMessage()]
        other = [r for r in caplog.records if "not this router's" in r.getMessage()]
        assert len(mixed) == 1 and len(other) == 1  # why, once each
        # A rolling weights update: the operator lists the new build's fingerprint; after a reload its chain is
        # used too, a mixed chain still never is, and a file that does not parse keeps the accepted ones.
        accepted = tmp_path / "accepted.txt"
        accepted.write_text("# the next build\n")
        router = RouterServer(RouterConfig(model=str(tiny_model), chains=specs, port=0, health_interval_s=0.1,
                                           accept_fingerprints=str(accepted)))
        await router.start()
        try:
            await asyncio.sleep(0.3)
            assert [c.healthy for c in router.chains.chains] == [False, False, True]
            accepted.write_text(f"# the next build\n{theirs[0].fingerprint}  # its Stage/Info fingerprint\n")
            router.reload()
            deadline = time.monotonic() + 30
            while not router.chains.chains[1].healthy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert [c.healthy for c in router.chains.chains] == [False, True, True]
            accepted.write_text("not a fingerprint\n")
            assert not router.reload_fingerprints()
            assert router.chains.accepted == {theirs[0].fingerprint[:16]}
        finally:
            await router.stop(0)
    finally:
        for server in ours + theirs:
            await server.stop(0)


async def test_router_uses_no_chain_of_another_stage_protocol_version(tiny_model):
    """A roll half done: stages of an older release (protocol 1, which would ignore this release's sampling fields)
    are not chained with this release's, and a chain of them alone is not used by this release's router."""
    current, older = [], []
    try:
        for servers in (current, older):
            for a, b in splits(4, 4):
                server = StageServer(StageConfig(model=str(tiny_model), port=0, layer_start=a, layer_end=b,
                                                 kv_cache_gb=0.1))
                await server.start(server.load(a, b))
                servers.append(server)
        for server in older:  # what an older build reports for the same checkpoint
            server.slot.current.fingerprint = server.fingerprint.rsplit("/", 1)[0] + "/p1"
        specs = [f"{current[0].address},{older[1].address}", f"{older[0].address},{older[1].address}",
                 f"{current[0].address},{current[1].address}"]
        router = RouterServer(RouterConfig(model=str(tiny_model), chains=specs, port=0, health_interval_s=0.1))
        await router.start()
        try:
            await asyncio.sleep(0.6)  # several health checks
            chains = router.chains.chains
            assert [c.healthy for c in chains] == [False, False, True]
            assert "mixes builds" in chains[0].problem
            assert f"speaks stage protocol 1, not this router's {PROTOCOL_VERSION}" in chains[1].problem
        finally:
            await router.stop(0)
    finally:
        for server in current + older:
            await server.stop(0)


async def until(predicate, what: str, timeout: float = 30.0) -> None:
    """Waits (bounded) for predicate() (a bool, or an awaitable of one) to hold."""
    deadline = time.monotonic() + timeout
    while not ((await held) if inspect.isawaitable(held := predicate()) else held):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_weights_replaced_on_disk_make_a_reassigned_stage_announce_them_and_no_chain_mixes_them(
        tiny_model, other_build, tmp_path):
    """A rolling weights update's first step: new files put in place under a serving stage. A stage that then
    reads a new range from them says it serves the new build (Info, the registry), not the one it started with,
    and a router refuses to chain it with a stage still serving the old weights."""
    rolling = shutil.copytree(tiny_model, tmp_path / tiny_model.name)
    plane = await ControlPlane(tiny_model).start()
    try:
        registry = open_registry(plane.url)
        plane.closers.append(registry.close)
        first, second = [await plane.add_stage(share_of_model=0.6, model=rolling) for _ in range(2)]
        service = {id(server): registration.service_id for server, registration in plane.stages}

        async def assign(server: StageServer, layers: tuple[int, int]) -> None:
            key = assignment_key(tiny_model.name, service[id(server)])
            await registry.kv_put(key, f"{layers[0]}:{layers[1]}".encode())
            await until(lambda: server.layers == layers, f"{server.address} loads {layers}")

        await assign(first, (0, 4))
        await assign(second, (0, 8))
        old = serving_fingerprint(model_fingerprint(tiny_model), "float32", "none")
        assert first.fingerprint == second.fingerprint == old
        plane.router = RouterServer(RouterConfig(model=str(tiny_model), chains=[second.address,
                                                                                f"{first.address},{second.address}"],
                                                 port=0, health_interval_s=0.1))
        await plane.router.start()
        whole, pair = plane.router.chains.chains
        await until(lambda: whole.healthy, "the one-stage chain is used")
        for name in {p.name for p in weight_files(other_build).values()}:  # put in place as a deploy would
            shutil.copy(other_build / name, rolling / f"{name}.new")
            os.replace(rolling / f"{name}.new", rolling / name)
        await assign(second, (4, 8))
        new = serving_fingerprint(model_fingerprint(other_build), "float32", "none")
        assert new != old and second.fingerprint == new and first.fingerprint == old
        channel = grpc_server.insecure_channel(second.address)
        plane.closers.append(channel.close)
        info = await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest())
        assert info.fingerprint == new

        async def registered() -> bool:
            records = {r.record.address: r.record.meta for r in await registry.services(tiny_model.name)}
            return records[second.address]["fingerprint"] == new and records[second.address]["layers"] == "4:8"

        await until(registered, "the stage registers the build it loaded")
        await until(lambda: "mixes builds" in pair.problem, "the mixed chain is refused")
        assert not pair.healthy and not whole.healthy  # the whole-model stage is gone too
        assert pair.fingerprint == f"{old}, {new}"
    finally:
        await plane.stop()


async def test_a_stage_of_another_build_never_takes_a_failed_stages_place(tiny_model, other_build, caplog, tmp_path):
    """During a rolling update a router serves two builds' chains (--accept-fingerprints). When a stage of one
    fails mid-stream, the other build's stage of the same layers does not take its place: a pass through two builds
    is no model at all. The stream is replayed on a chain of one build instead, said and counted."""
    caplog.set_level(logging.INFO, logger="stagemesh.router")
    builds: list[list[StageServer]] = [[], []]
    router = None
    try:
        for model, servers in zip((tiny_model, other_build), builds, strict=True):
            for a, b in splits(4, 4):
                server = StageServer(StageConfig(model=str(model), port=0, layer_start=a, layer_end=b, kv_cache_gb=0.1))
                await server.start(server.load(a, b))
                servers.append(server)
        accepted = tmp_path / "accepted.txt"
        accepted.write_text(f"{builds[1][0].fingerprint}\n")
        router = RouterServer(RouterConfig(model=str(tiny_model), port=0, health_interval_s=0.1,
                                           chains=[",".join(s.address for s in servers) for servers in builds],
                                           accept_fingerprints=str(accepted), probe=NO_PROBES))
        await router.start()
        deadline = time.monotonic() + 30
        while not all(c.healthy for c in router.chains.chains):
            assert time.monotonic() < deadline, "both builds' chains usable"
            await asyncio.sleep(0.05)
        channel = grpc_server.insecure_channel(router.address)
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(token_ids=[3, 1, 4, 1, 5], max_new_tokens=16))
        got = list((await call.read()).token_ids)
        serving = next(servers for servers in builds if servers[1].sessions.sessions)
        await serving[1].stop(0)
        while (response := await call.read()) is not grpc.aio.EOF:
            got.extend(response.token_ids)
        await channel.close()
        assert len(got) == 16
        assert "takes its place" not in caplog.text
        assert "not repairing, replaying instead: no other stage of this build serves those layers" in caplog.text
    finally:
        if router is not None:
            await router.stop(0)
        for server in builds[0] + builds[1]:
            await server.stop(0)
