"""Malformed and extreme input at the router and a stage, from hypothesis and as raw bytes: every call
ends, within its bound, with a defined status; nothing crashes; the mesh still serves afterwards."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.conftest import hf_greedy, splits, start_mesh

CALL_TIMEOUT_S = 20.0
GENERATE_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
"""What a Generate (or a GenerateBatch entry) may end with, here: served (OK), or refused for what it asks: a
field out of bounds (INVALID_ARGUMENT) or a prompt longer than the model's context (OUT_OF_RANGE). The mesh has
room for every short stream the fuzz asks for; UNAVAILABLE would say a request took its one chain down,
DEADLINE_EXCEEDED a hang, UNKNOWN or INTERNAL a crash."""
OPEN_SESSION_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                      grpc.StatusCode.ALREADY_EXISTS}
"""A stage's OpenSession: opened, or an empty session_id (INVALID_ARGUMENT), a max_length outside the model's
context (OUT_OF_RANGE), an id the fuzz opened before (ALREADY_EXISTS). Its 1 GB pool holds the look-ahead of
~3,000 sessions (64 positions each): never full here."""
FORWARD_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.NOT_FOUND}
"""A stage's step (on Sessions): run, or a malformed tensor or a start that is not the session's next position
(INVALID_ARGUMENT), a step past its max_length (OUT_OF_RANGE), a session not open (NOT_FOUND)."""

int32 = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
text = st.text(max_size=300)

generate_requests = st.builds(
    router_pb2.GenerateRequest,
    prompt=st.one_of(st.just(""), text, st.text(min_size=1, max_size=3).map(lambda s: s * 5000)),
    token_ids=st.lists(int32, max_size=40),
    max_new_tokens=st.one_of(st.integers(-5, 8), int32),
    temperature=floats,
    top_k=int32,
    top_p=floats,
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=40), max_size=20),
    priority=int32,
    request_id=st.one_of(st.just(""), text, st.just("x" * 16384), st.just("line\nbreak")),
    min_p=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=floats,
    logit_bias=st.dictionaries(int32, floats, max_size=4),
    logprobs=st.booleans(),
    top_logprobs=st.one_of(st.integers(-2, 25), int32),
    stop_token_ids=st.lists(st.one_of(st.integers(-2, 1100), int32), max_size=4),
    ignore_eos=st.booleans(),
    min_tokens=st.one_of(st.integers(-2, 10), int32),
)

tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "int8", "int64", "int32", "complex64", "", "bogus"]),
    shape=st.lists(st.integers(-3, 300), max_size=3),
    data=st.binary(max_size=4096),
    row_scale=st.lists(floats, max_size=4),
)


class MeshThread:
    """A one-stage mesh served from its own event loop thread, so that the hypothesis tests can be
    plain synchronous functions with blocking gRPC clients."""

    def __init__(self, model):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.mesh = self._call(start_mesh(model, [splits(3, 5)]), 120)
        self.router = grpc.insecure_channel(self.mesh.router.address)
        self.stage = grpc.insecure_channel(self.mesh.stages[0][1].address)

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.router.close()
        self.stage.close()
        self._call(self.mesh.stop(), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tiny_model):
    mesh = MeshThread(tiny_model)
    yield mesh
    mesh.close()


def _code_of(call) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def assert_still_serves(served, hf_model) -> None:
    """The chain serves a stream, token for token as transformers does, and the router never took it down."""
    stub = router_pb2_grpc.RouterStub(served.router)
    out = list(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=8), timeout=30))
    assert [t for r in out for t in r.token_ids] == hf_greedy(hf_model, [5, 6, 7], 8)
    assert [c.healthy for c in served.mesh.router.chains.chains] == [True]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=generate_requests)
@example(request=router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=2, request_id="line\nbreak"))
@example(request=router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=2, request_id="caf\u00e9"))
@example(request=router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=2, request_id="x" * 16384))
@example(request=router_pb2.GenerateRequest(prompt="hi", max_new_tokens=2, temperature=1e-40))
@example(request=router_pb2.GenerateRequest(token_ids=[5, 6, 1_000_000], max_new_tokens=2))  # outside the vocabulary
def test_any_generate_request_gets_a_defined_status(served, request):
    stub = router_pb2_grpc.RouterStub(served.router)
    request.max_new_tokens = min(request.max_new_tokens, 8)  # valid ones stay short
    assert _code_of(stub.Generate(request, timeout=CALL_TIMEOUT_S)) in GENERATE_CODES


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(generate_requests, max_size=4))
@example(requests=[router_pb2.GenerateRequest(token_ids=[5, 6, 1_000_000], max_new_tokens=2),
                   router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=2)])
def test_any_generate_batch_gets_a_defined_status_and_one_answer_per_index(served, requests):
    stub = router_pb2_grpc.RouterStub(served.router)
    for r in requests:
        r.max_new_tokens = min(r.max_new_tokens, 4)
    call = stub.GenerateBatch(router_pb2.GenerateBatchRequest(requests=requests), timeout=CALL_TIMEOUT_S)
    answered, codes = set(), set()
    try:
        for item in call:
            if item.error_code or item.response.finish_reason:
                answered.add(item.index)
                codes.add(grpc.StatusCode.OK if not item.error_code else
                          next(c for c in grpc.StatusCode if c.value[0] == item.error_code))
    except grpc.RpcError as exc:
        assert exc.code() in GENERATE_CODES
        return
    assert answered == set(range(len(requests)))  # no entry silently dropped
    assert codes <= GENERATE_CODES


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(session_id=st.text(max_size=50), start=int32, hidden=tensors, max_length=int32)
def test_any_forward_step_gets_a_defined_status(served, session_id, start, hidden, max_length):
    stub = stage_pb2_grpc.StageStub(served.stage)
    try:
        stub.OpenSession(stage_pb2.OpenSessionRequest(session_id=session_id, max_length=max_length),
                         timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        assert exc.code() in OPEN_SESSION_CODES
    step = stage_pb2.ForwardRequest(session_id=session_id, start=start, hidden=hidden)
    assert _step_code(stub, step) in FORWARD_CODES


def _step_code(stub: stage_pb2_grpc.StageStub, step: stage_pb2.ForwardRequest) -> grpc.StatusCode:
    """The step on a Sessions call of its own, as a router sends it: its session's fault, or OK for its answer."""
    answered = threading.Event()

    def batches():
        yield stage_pb2.SessionBatch(steps=[step])
        answered.wait(CALL_TIMEOUT_S)  # the call stays open until the answer is read

    call = stub.Sessions(batches(), timeout=CALL_TIMEOUT_S)
    try:
        for events in call:
            if events.faults:
                return next(c for c in grpc.StatusCode if c.value[0] == events.faults[0].code)
            if events.results:
                return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        answered.set()
        call.cancel()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("garbage", [b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                     b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 512, bytes(range(256)) * 8])
def test_garbage_bytes_at_every_port_leave_the_mesh_serving(served, hf_models, garbage):
    addresses = [served.mesh.router.address, *(s.address for s in served.mesh.all_stages())]
    for address in addresses:
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.settimeout(5)
            sock.sendall(garbage)
            try:
                sock.recv(1024)
            except (TimeoutError, ConnectionError):
                pass
    assert_still_serves(served, hf_models["llama"])


def test_the_mesh_serves_after_the_fuzzing(served, hf_models):
    assert_still_serves(served, hf_models["llama"])
