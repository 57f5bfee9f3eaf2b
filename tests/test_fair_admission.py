"""Fair admission (issue 45): callers take turns within a priority class, a flood of a lower class never holds a
higher one back, per-caller limits from the tokens file refuse with RESOURCE_EXHAUSTED naming the limit, and
--max-stream-seconds ends a stream and frees its slot. Real router and stages on loopback; orders, not timings."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from stagemesh.router.auth import CallerLimits
from stagemesh.router.priority_queue import AdmissionConfig, ClassLimits, PriorityAdmission
from stagemesh.v1 import router_pb2
from tests.conftest import collect, splits, start_mesh, until
from tests.test_traffic import request

TOKENS = {"flooder": "flooder-token-0001", "other": "other-token-00002", "capped": "capped-token-00003",
          "metered": "metered-token-0004", "queued": "queued-token-00005"}
LIMITS = {"capped": {"max_new_tokens": 8}, "metered": {"tokens_per_minute": 40},
          "queued": {"max_concurrent": 1, "max_queued": 1}}
WAIT_S = 120.0
"""Bounds every wait here, generous for a machine 10x slower; the assertions are on orders and codes."""


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [{"name": n, "token": t, "max_priority": 1, **LIMITS.get(n, {})}
                                           for n, t in TOKENS.items()]}))
    path.chmod(0o600)
    return str(path)


async def test_a_callers_200_queued_requests_do_not_delay_anothers_one_past_the_next_free_slot(tiny_model,
                                                                                               tokens_file):
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={
        "admission": AdmissionConfig(slots_per_chain=1, limits={"high": ClassLimits(), "batch": ClassLimits(),
                                                                 "normal": ClassLimits(max_wait_s=WAIT_S)}),
        "auth_tokens": tokens_file})
    try:
        stub, queue = mesh.router_stub, mesh.router.admission
        done: list[str] = []

        async def call(name: str, i: int) -> None:
            await collect(stub.Generate(request([5, 6, i % 50 + 1], 2), metadata=bearer(name), timeout=WAIT_S))
            done.append(name)

        flood = [asyncio.ensure_future(call("flooder", i)) for i in range(200)]
        await until(lambda: queue.waiting_in("normal") >= 150, WAIT_S, "the flooder's requests wait")
        other = asyncio.ensure_future(call("other", 0))
        await until(lambda: queue.waiting_by["other"] == 1 or other.done(), WAIT_S, "the other caller's one waits")
        before = done.count("flooder")
        await asyncio.wait_for(other, WAIT_S)
        # At most the stream running when it came finishes first: the next free slot is the other caller's.
        assert done.count("flooder") - before <= 1, f"{done.count('flooder') - before} flooder streams went first"
        assert queue.waiting_in("normal") > 100, "the flood was served before the other caller's request"
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await until(lambda: queue.running == 0 and not queue.waiting, WAIT_S, "the queue empties")
    finally:
        await mesh.stop()


async def test_a_batch_flood_does_not_hold_a_high_priority_request_back(tiny_model):
    """A flood of batch requests waiting many aging periods (uncapped aging ranked them above a fresh high one after
    two) does not get ahead of a high-priority request: it takes the next free slot."""
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={"admission": AdmissionConfig(
        slots_per_chain=1, aging_s=0.05, limits={"high": ClassLimits(), "normal": ClassLimits(),
                                                 "batch": ClassLimits(max_wait_s=WAIT_S)})})
    try:
        stub, queue = mesh.router_stub, mesh.router.admission
        done: list[str] = []

        async def call(cls: str, priority: int, i: int) -> None:
            await collect(stub.Generate(request([5, 7, i % 50 + 1], 2, priority=priority), timeout=WAIT_S))
            done.append(cls)

        flood = [asyncio.ensure_future(call("batch", -1, i)) for i in range(60)]
        await until(lambda: queue.waiting_in("batch") >= 40, WAIT_S, "the batch flood waits")
        await asyncio.sleep(0.5)  # ten aging periods
        high = asyncio.ensure_future(call("high", 1, 0))
        await until(lambda: queue.waiting_in("high") == 1 or high.done(), WAIT_S, "the high request waits")
        before = done.count("batch")
        await asyncio.wait_for(high, WAIT_S)
        assert done.count("batch") - before <= 1, f"{done.count('batch') - before} batch streams went first"
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    finally:
        await mesh.stop()


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    return err.value


async def test_per_caller_limits_refuse_with_resource_exhausted_naming_the_limit(tiny_model, tokens_file):
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={
        "admission": AdmissionConfig(slots_per_chain=8), "auth_tokens": tokens_file})
    try:
        stub, queue = mesh.router_stub, mesh.router.admission
        err = await refused(stub.Generate(request([5, 6], 9), metadata=bearer("capped"), timeout=WAIT_S))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_new_tokens" in err.details()
        await collect(stub.Generate(request([5, 6], 8), metadata=bearer("capped"), timeout=WAIT_S))

        await collect(stub.Generate(request([5, 6, 7], 30), metadata=bearer("metered"), timeout=WAIT_S))  # 33
        err = await refused(stub.Generate(request([5, 6, 7], 30), metadata=bearer("metered"), timeout=WAIT_S))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in err.details()

        holder = stub.Generate(request([5, 6], 2000), metadata=bearer("queued"), timeout=WAIT_S)
        await until(lambda: queue.running_by["queued"] == 1, WAIT_S, "the queued caller's first stream runs")
        second = asyncio.ensure_future(collect(stub.Generate(request([5, 6], 2), metadata=bearer("queued"),
                                                             timeout=WAIT_S)))
        await until(lambda: queue.waiting_by["queued"] == 1, WAIT_S, "its second waits: max_concurrent 1")
        assert queue.running < queue.slots, "it waits for its own limit, not for a slot"
        err = await refused(stub.Generate(request([5, 6], 2), metadata=bearer("queued"), timeout=WAIT_S))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued" in err.details()
        await collect(stub.Generate(request([5, 6], 2), metadata=bearer("other"), timeout=WAIT_S))  # not held
        holder.cancel()
        await asyncio.wait_for(second, WAIT_S)  # its turn came when its first stream ended
    finally:
        await mesh.stop()


async def test_tokens_a_stream_did_not_generate_are_given_back():
    """tokens_per_minute charges prompt + max_new_tokens up front; a stream that stopped early gets back what it
    did not use, so the next request fits where it would not have."""
    admission = PriorityAdmission(AdmissionConfig(), lambda: 1)
    limits = CallerLimits(tokens_per_minute=100)
    ticket = await admission.acquire(0, caller="c", limits=limits, prompt_tokens=10, max_new_tokens=80)
    admission.release(ticket, used_tokens=20)  # stopped after 10 new tokens: 70 back
    await admission.acquire(0, caller="c", limits=limits, prompt_tokens=10, max_new_tokens=60)
    assert admission.running == 1
    with pytest.raises(Exception, match="tokens_per_minute"):
        await admission.acquire(0, caller="c", limits=limits, prompt_tokens=10, max_new_tokens=60)


async def test_a_stream_past_max_stream_seconds_ends_and_frees_its_slot(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={
        "admission": AdmissionConfig(slots_per_chain=1, max_stream_seconds=0.5)})
    try:
        stub = mesh.router_stub
        err = await refused(stub.Generate(request([5, 6], 2000), timeout=WAIT_S))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-stream-seconds" in err.details()
        await until(lambda: mesh.router.admission.running == 0, WAIT_S, "its slot is free")
        responses = [r async for r in stub.Generate(request([5, 6], 2), timeout=WAIT_S)]
        assert responses[-1].finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED
    finally:
        await mesh.stop()
