"""Callers' tokens at the router (`--auth-tokens FILE`): who may call, at which priority, how often;
reloaded without a restart; the tokens themselves in no log line."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY, generate_latest

from stagemesh import grpc_server
from stagemesh.launcher import LocalMesh, stage_env
from stagemesh.log import JsonFormatter
from stagemesh.router.auth import TokenBucket, parse_tokens
from stagemesh.v1 import router_pb2, router_pb2_grpc
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.harness.fault_mesh import free_port
from tests.test_exactness import prompt

BILLING = "billing-0123456789abcdef-secret"
OPS = "ops-0123456789abcdef-secret-token"
SLOW = "slow-0123456789abcdef-secret-tok"
NEWCOMER = "newcomer-0123456789abcdef-secret"
TEAM_X = "team-x-0123456789abcdef-secret-t"
TEAM_Y = "team-y-0123456789abcdef-secret-t"
ALL_TOKENS = (BILLING, OPS, SLOW, NEWCOMER, TEAM_X, TEAM_Y)
PROMPT = [21, 22, 23, 24]


def token_file(path: Path, *entries: dict) -> Path:
    path.write_text(json.dumps({"tokens": list(entries)}))
    path.chmod(0o600)
    return path


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def tokens_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("auth") / "tokens.json"


@pytest.fixture(scope="module")
async def mesh(tiny_model, tokens_path):
    token_file(tokens_path,
               {"name": "billing", "token": BILLING, "max_priority": 0, "requests_per_second": 1000},
               {"name": "ops", "token": OPS, "max_priority": 5},
               {"name": "slow", "token": SLOW, "requests_per_second": 0.1},
               {"name": "team-x", "token": TEAM_X, "cache_group": "team"},
               {"name": "team-y", "token": TEAM_Y, "cache_group": "team"})
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router_options={"auth_tokens": str(tokens_path)})
    yield mesh
    await mesh.stop()


async def code_of(call) -> grpc.StatusCode:
    """The status a call ends with (OK if it ends well), reading a stream to its end."""
    try:
        result = call
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def calls(stub: router_pb2_grpc.RouterStub, metadata, priority: int = 0) -> dict[str, Callable]:
    """Each Router method, to call with this metadata (a call starts when made, so each is made on demand)."""
    request = router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=2, priority=priority)
    return {
        "Generate": lambda: stub.Generate(request, metadata=metadata, timeout=30),
        "GenerateBatch": lambda: stub.GenerateBatch(router_pb2.GenerateBatchRequest(requests=[request]),
                                                    metadata=metadata, timeout=30),
        "ListChains": lambda: stub.ListChains(router_pb2.ListChainsRequest(), metadata=metadata, timeout=10),
    }


async def status(stub: router_pb2_grpc.RouterStub, method: str, metadata, priority: int = 0) -> grpc.StatusCode:
    return await code_of(calls(stub, metadata, priority)[method]())


@pytest.mark.parametrize("metadata", [
    [], bearer("not-a-token-of-ours-at-all"), [("authorization", BILLING)], [("authorization", f"Basic {BILLING}")],
    bearer(BILLING[:-1]), [("x-token", BILLING)],
], ids=["none", "wrong", "no scheme", "basic", "a prefix of a good one", "another header"])
async def test_a_call_without_a_valid_token_is_unauthenticated(mesh, metadata):
    stub = mesh.router_stub
    for method, call in calls(stub, metadata).items():
        assert await code_of(call()) == grpc.StatusCode.UNAUTHENTICATED, method


async def test_a_good_token_gets_the_exact_stream_and_the_chains(mesh, hf_models):
    stub = mesh.router_stub
    ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=10),
                                            metadata=bearer(BILLING), timeout=30))
    assert ids == hf_greedy(hf_models["llama"], PROMPT, 10)
    chains = await stub.ListChains(router_pb2.ListChainsRequest(), metadata=bearer(BILLING), timeout=10)
    assert len(chains.chains) == 1
    assert not any(t in str(chains) for t in ALL_TOKENS)
    batch = [r async for r in stub.GenerateBatch(router_pb2.GenerateBatchRequest(requests=[
        router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=3)] * 2), metadata=bearer(BILLING), timeout=30)]
    assert {r.index for r in batch} == {0, 1} and not any(r.error_code for r in batch)


async def test_health_and_reflection_stay_open(mesh):
    async with grpc_server.insecure_channel(mesh.router.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        services = [s.name async for r in stream for s in r.list_services_response.service]
        assert "stagemesh.v1.Router" in services


async def test_a_priority_above_the_tokens_allowance_is_permission_denied(mesh):
    stub = mesh.router_stub
    for method, call in calls(stub, bearer(BILLING), priority=1).items():
        expected = grpc.StatusCode.OK if method == "ListChains" else grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(call()) == expected, method
    with pytest.raises(grpc.aio.AioRpcError) as err:  # and it says why: the caller's name and its allowance
        await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=2, priority=1),
                                    metadata=bearer(BILLING), timeout=30))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "max_priority 0" in err.value.details() and "billing" in err.value.details()
    for method, call in calls(stub, bearer(OPS), priority=5).items():  # its own allowance is fine
        assert await code_of(call()) == grpc.StatusCode.OK, method
    assert await status(stub, "Generate", bearer(OPS), priority=6) == grpc.StatusCode.PERMISSION_DENIED
    # batch priority: < 0 is always within a token's allowance
    assert await status(stub, "Generate", bearer(BILLING), priority=-3) == grpc.StatusCode.OK


async def test_over_its_rate_a_caller_is_resource_exhausted(mesh):
    stub = mesh.router_stub
    list_chains = lambda: stub.ListChains(router_pb2.ListChainsRequest(), metadata=bearer(SLOW), timeout=10)  # noqa: E731
    # One request per 10 s, a burst of one (the bucket starts full; the rest is test_token_buckets_...).
    assert await code_of(list_chains()) == grpc.StatusCode.OK
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await list_chains()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "0.1 requests per second" in err.value.details()
    assert await status(stub, "ListChains", bearer(BILLING)) == grpc.StatusCode.OK  # others unaffected
    two = router_pb2.GenerateBatchRequest(requests=[router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=2)] * 2)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # two prompts at once: more than a burst of 1
        async for _ in stub.GenerateBatch(two, metadata=bearer(SLOW), timeout=30):
            pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "split the batch" in err.value.details()


def test_token_buckets_refill_at_their_rate():
    now = [0.0]
    bucket = TokenBucket(2.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [True, True, False]  # burst = rate
    now[0] += 0.5
    assert [bucket.take(), bucket.take()] == [True, False]
    now[0] += 10
    assert not bucket.take(3)  # more than the burst: refused, and takes nothing
    assert bucket.take(2) and not bucket.take()  # never more than the burst, however long it waited
    slow = TokenBucket(0.5, clock=lambda: now[0])
    assert slow.take() and not slow.take()  # a rate under 1 still lets one request through at a time
    now[0] += 2
    assert slow.take()


async def test_reload_adds_and_revokes_tokens_without_a_restart(mesh, tokens_path):
    stub = mesh.router_stub
    before = tokens_path.read_text()
    try:
        token_file(tokens_path, {"name": "ops", "token": OPS, "max_priority": 5},
                   {"name": "newcomer", "token": NEWCOMER})
        assert mesh.router.reload_tokens()
        assert await status(stub, "ListChains", bearer(BILLING)) == grpc.StatusCode.UNAUTHENTICATED
        assert await status(stub, "Generate", bearer(NEWCOMER)) == grpc.StatusCode.OK
        assert await status(stub, "ListChains", bearer(OPS)) == grpc.StatusCode.OK
        # A file that does not parse changes nothing: the tokens in force stay in force.
        tokens_path.write_text('{"tokens": [{"name": "x", "token": "short"}]}')
        assert not mesh.router.reload_tokens()
        assert await status(stub, "ListChains", bearer(NEWCOMER)) == grpc.StatusCode.OK
    finally:
        tokens_path.write_text(before)
        assert mesh.router.reload_tokens()
    assert await status(stub, "ListChains", bearer(NEWCOMER)) == grpc.StatusCode.UNAUTHENTICATED
    assert await status(stub, "ListChains", bearer(BILLING)) == grpc.StatusCode.OK


async def test_logs_name_the_caller_and_never_show_a_token(mesh, caplog):
    caplog.set_level(logging.DEBUG)
    stub = mesh.router_stub
    await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=3, request_id="r-auth-1"),
                                metadata=bearer(BILLING), timeout=30))
    for metadata, priority in ((bearer(BILLING), 9), (bearer(BILLING[:-1] + "x"), 0), ([], 0)):
        await status(stub, "Generate", metadata, priority)
    mesh.router.reload_tokens()
    formatted = [JsonFormatter().format(r) for r in caplog.records]
    lines = [json.loads(f) for f in formatted]
    assert any(e.get("request_id") == "r-auth-1" and e.get("caller") == "billing" and "generate" in e["msg"]
               for e in lines), formatted
    assert any(e.get("caller") == "billing" and e.get("code") == "PERMISSION_DENIED" for e in lines), formatted
    assert any(e.get("code") == "UNAUTHENTICATED" for e in lines), formatted
    text = "\n".join(formatted)
    assert not any(t in text or t[:-1] in text for t in ALL_TOKENS)


@pytest.mark.parametrize(("doc", "message"), [
    ("not json", "not JSON"),
    ('{"callers": []}', 'expected {"tokens"'),
    ('{"tokens": [{"name": "a", "token": "short"}]}', "at least 16"),
    ('{"tokens": [{"name": "a", "token": "has a space in it ok"}]}', "without spaces"),
    ('{"tokens": [{"name": "", "token": "0123456789abcdefgh"}]}', "name must be"),
    ('{"tokens": [{"name": "a", "token": "0123456789abcdefgh", "max_prio": 1}]}', "unknown field"),
    ('{"tokens": [{"name": "a", "token": "0123456789abcdefgh", "max_priority": 1.5}]}', "max_priority must be"),
    ('{"tokens": [{"name": "a", "token": "0123456789abcdefgh", "requests_per_second": 0}]}', "requests_per_second"),
    ('{"tokens": [{"name": "a", "token": "0123456789abcdefgh"}, {"name": "a", "token": "0123456789abcdefgX"}]}',
     "names must be unique"),
    ('{"tokens": [{"name": "a", "token": "0123456789abcdefgh"}, {"name": "b", "token": "0123456789abcdefgh"}]}',
     "the same token"),
])
def test_a_malformed_token_file_is_refused_without_showing_tokens(doc, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_tokens(doc, "tokens.json")
    assert "0123456789abcdefg" not in str(err.value)


def test_sighup_reloads_the_tokens_of_a_router_process(tiny_model, tmp_path):
    """`stagemesh router --auth-tokens FILE`: SIGHUP swaps the tokens in place; the process's log names the
    caller and holds no token. (A router over a stage that is not there: ListChains answers all the same.)"""
    path = token_file(tmp_path / "tokens.json", {"name": "billing", "token": BILLING})
    accepted = tmp_path / "accepted.txt"  # and --accept-fingerprints with them
    accepted.write_text("")
    mesh = LocalMesh(str(tiny_model), tmp_path)
    router = mesh.spawn("router", ["router", "--model", str(tiny_model), "--port", "0", "--auth-tokens", str(path),
                                   "--accept-fingerprints", str(accepted), "--chain", f"127.0.0.1:{free_port()}"],
                        stage_env(1))
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            def list_chains(metadata) -> grpc.StatusCode:
                try:
                    stub.ListChains(router_pb2.ListChainsRequest(), metadata=metadata, timeout=10)
                except grpc.RpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert list_chains(bearer(BILLING)) == grpc.StatusCode.OK
            assert list_chains([]) == grpc.StatusCode.UNAUTHENTICATED
            token_file(path, {"name": "newcomer", "token": NEWCOMER})
            accepted.write_text("0123456789abcdef/float32/none/p2\n")
            os.kill(router.popen.pid, signal.SIGHUP)
            deadline = time.monotonic() + 20
            while list_chains(bearer(BILLING)) == grpc.StatusCode.OK and time.monotonic() < deadline:
                time.sleep(0.1)
            assert list_chains(bearer(BILLING)) == grpc.StatusCode.UNAUTHENTICATED
            assert list_chains(bearer(NEWCOMER)) == grpc.StatusCode.OK
            with pytest.raises(grpc.RpcError) as err:  # no chain to serve it: logged with the caller's name
                list(stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=2),
                                   metadata=bearer(NEWCOMER), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert router.popen.poll() is None  # SIGHUP did not end it
    finally:
        mesh.stop()
    log = router.log_path.read_text()
    assert '"caller": "newcomer"' in log and "tokens reloaded" in log
    assert "accepted fingerprints reloaded: 0123456789abcdef" in log
    assert not any(t in log for t in ALL_TOKENS)


async def test_requests_are_counted_per_caller_by_name_and_never_by_token(mesh):
    before = REGISTRY.get_sample_value("stagemesh_router_caller_requests_total",
                                       {"caller": "billing", "status": "OK"}) or 0.0
    ids, _, _ = await collect(mesh.router_stub.Generate(
        router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=2), metadata=bearer(BILLING), timeout=30))
    assert len(ids) == 2
    after = REGISTRY.get_sample_value("stagemesh_router_caller_requests_total", {"caller": "billing", "status": "OK"})
    assert after == before + 1
    exposition = generate_latest(REGISTRY).decode()
    assert not any(t in exposition for t in ALL_TOKENS)


async def cached_tokens(mesh, ids: list[int], token: str, cache_salt: str = "") -> int:
    """What the router reports of ids's blocks as cached for this caller (the stream's last response)."""
    _, _, responses = await collect(mesh.router_stub.Generate(
        router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=2, cache_salt=cache_salt), metadata=bearer(token),
        timeout=30))
    return responses[-1].cached_tokens


async def test_a_callers_prefix_cache_is_its_own(mesh):
    """Tenant B sending tenant A's prompt learns nothing of it: B's blocks are B's; A's second request finds A's."""
    ids = prompt(40, seed=451)  # 2 full blocks of 16 before the last token
    assert [await cached_tokens(mesh, ids, t) for t in (BILLING, OPS, BILLING, OPS)] == [0, 0, 32, 32]


async def test_a_cache_salt_narrows_a_callers_cache_and_a_cache_group_widens_it(mesh):
    ids = prompt(40, seed=452)
    assert [await cached_tokens(mesh, ids, BILLING, salt) for salt in ("one", "two", "one", "")] == [0, 0, 32, 0]
    other = prompt(40, seed=453)
    assert [await cached_tokens(mesh, other, t) for t in (TEAM_X, TEAM_Y, OPS)] == [0, 32, 0]


async def test_a_cache_salt_over_256_bytes_is_invalid(mesh):
    call = mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=2,
                                                                cache_salt="é" * 129), metadata=bearer(OPS), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt has 258 bytes" in err.value.details()
