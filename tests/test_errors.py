"""One error shape on every server: a StatusError reaches the caller as its code and message; any
other exception is logged once with the request id and answered INTERNAL with a fixed message that
never carries the exception's text. Real servers on loopback; the fault is planted in-process."""

from __future__ import annotations

import logging

import grpc
import pytest

from stagemesh import wire
from stagemesh.errors import REQUEST_ID_KEY, StatusError
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import StageSessions, collect, splits, start_mesh

SECRET = "secret detail"


@pytest.fixture(scope="module")
async def mesh(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    yield mesh
    await mesh.stop()


def raises(exc: Exception):
    """A stand-in for a method that fails with exc."""

    def fail(*args, **kwargs):
        raise exc

    return fail


def raises_async(exc: Exception):
    """A stand-in for a coroutine method that fails with exc."""

    async def fail(*args, **kwargs):
        raise exc

    return fail


def step(session_id: str, ids: list[int]) -> stage_pb2.ForwardRequest:
    return stage_pb2.ForwardRequest(session_id=session_id, start=0, token_ids=wire.encode_ids(ids))


async def step_on_sessions(stub, request: stage_pb2.ForwardRequest) -> None:
    """The step on a Sessions call of its own: its session's fault raised as a call's error."""
    stream = StageSessions(stub)
    try:
        await stream.send(steps=[request])
        await stream.read()
    finally:
        stream.cancel()


def logged_failures(caplog, request_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info and getattr(r, "request_id", None) == request_id]


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call) if hasattr(call, "__aiter__") else await call
    return err.value


async def open_sessions(mesh) -> int:
    return (await mesh.stage_stub(0, 0).Info(stage_pb2.InfoRequest())).open_sessions


async def test_unexpected_stage_error_in_a_stream_is_internal_logged_once_and_kept_secret(mesh, monkeypatch, caplog):
    stage = mesh.stages[0][0]
    monkeypatch.setattr(stage.batcher, "submit", raises_async(RuntimeError(SECRET)))
    stub = mesh.stage_stub(0, 0)
    await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="boom", max_length=16,
                                                        request_id="req-stream-42"))
    with caplog.at_level(logging.ERROR, logger="stagemesh.stage"):
        err = await rpc_error(step_on_sessions(stub, step("boom", [3, 4])))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == (f"internal error in Stage/Sessions on {stage.address}; "
                             "the stage logged it with request id req-stream-42")
    assert SECRET not in err.details()
    [record] = logged_failures(caplog, "req-stream-42")
    assert isinstance(record.exc_info[1], RuntimeError) and SECRET in str(record.exc_info[1])
    assert await open_sessions(mesh) == 0  # the session's fault closed it


async def test_unexpected_unary_error_names_the_request_id_of_the_message(mesh, monkeypatch, caplog):
    """No x-request-id metadata: the request's own request_id ties the answer to the log line."""
    monkeypatch.setattr(mesh.stages[0][0].sessions, "open", raises(ZeroDivisionError("division by zero")))
    with caplog.at_level(logging.ERROR, logger="stagemesh.stage"):
        err = await rpc_error(mesh.stage_stub(0, 0).OpenSession(
            stage_pb2.OpenSessionRequest(session_id="div", max_length=16, request_id="req-unary-7")))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == ("internal error in stagemesh.v1.Stage/OpenSession; "
                             "the server logged it with request id req-unary-7")
    assert "division" not in err.details()
    assert len(logged_failures(caplog, "req-unary-7")) == 1


async def test_unexpected_router_error_in_a_response_stream_is_internal(mesh, monkeypatch, caplog):
    monkeypatch.setattr(mesh.router.service, "to_generation_request", raises(RuntimeError(SECRET)))
    with caplog.at_level(logging.ERROR, logger="stagemesh.router"):
        err = await rpc_error(mesh.router_stub.Generate(
            router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=3), timeout=10,
            metadata=((REQUEST_ID_KEY, "req-router-1"),)))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == ("internal error in stagemesh.v1.Router/Generate; "
                             "the server logged it with request id req-router-1")
    assert len(logged_failures(caplog, "req-router-1")) == 1


async def test_status_error_keeps_its_code_and_message_on_unary_calls(mesh, monkeypatch, caplog):
    refusal = StatusError(grpc.StatusCode.FAILED_PRECONDITION, "come back when the moon is full")
    monkeypatch.setattr(mesh.stages[0][0].sessions, "open", raises(refusal))
    with caplog.at_level(logging.ERROR):
        err = await rpc_error(mesh.stage_stub(0, 0).OpenSession(
            stage_pb2.OpenSessionRequest(session_id="moon", max_length=16)))
    assert (err.code(), err.details()) == (grpc.StatusCode.FAILED_PRECONDITION, "come back when the moon is full")
    assert not [r for r in caplog.records if r.exc_info]  # a refusal is not a bug: nothing logged


async def test_status_error_keeps_its_code_and_message_on_a_sessions_step(mesh, monkeypatch):
    monkeypatch.setattr(mesh.stages[0][0].batcher, "submit",
                        raises_async(StatusError(grpc.StatusCode.ABORTED, "this step was aborted")))
    stub = mesh.stage_stub(0, 0)
    await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="aborted", max_length=16))
    err = await rpc_error(step_on_sessions(stub, step("aborted", [3])))
    assert (err.code(), err.details()) == (grpc.StatusCode.ABORTED, "this step was aborted")
    assert await open_sessions(mesh) == 0


async def test_status_error_keeps_its_code_and_message_on_response_streams(mesh, monkeypatch):
    monkeypatch.setattr(mesh.router.admission, "acquire",
                        raises_async(StatusError(grpc.StatusCode.PERMISSION_DENIED, "not this caller")))
    err = await rpc_error(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5], max_new_tokens=2),
                                                    timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.PERMISSION_DENIED, "not this caller")


async def test_domain_errors_keep_their_codes_and_text(mesh):
    """The stage's table (stage_service.ERROR_CODES) answers its domain errors with their own text."""
    err = await rpc_error(step_on_sessions(mesh.stage_stub(0, 0), step("never-opened", [3])))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "no open session 'never-opened'" in err.details()


async def test_a_stage_bug_does_not_leak_through_the_router(tiny_model, monkeypatch):
    """The router retries elsewhere, then tells the caller the request failed (INTERNAL: a fault of
    this request's steps, not of a chain, which stays up); the stage's secret stays in its log."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        monkeypatch.setattr(mesh.stages[0][1].batcher, "submit", raises_async(RuntimeError(SECRET)))
        err = await rpc_error(mesh.router_stub.Generate(
            router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=3), timeout=10))
        assert err.code() == grpc.StatusCode.INTERNAL
        assert SECRET not in err.details()
        assert all(c.healthy for c in mesh.router.chains.chains)
    finally:
        await mesh.stop()
