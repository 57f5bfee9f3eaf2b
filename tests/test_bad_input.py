"""Bad input gets a clear status, never a crash or a hang, and other sessions keep streaming."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.v1 import router_pb2, stage_pb2, tensor_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh, step_status
from tests.test_kv_pool import kv_gb_for_blocks


@pytest.fixture(scope="module")
async def mesh(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(3, 5)])
    yield mesh
    await mesh.stop()


async def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.details()  # every refusal says what was wrong
    return err.value.code()


@pytest.mark.parametrize(
    "request_fields, code",
    [
        ({"max_new_tokens": 5}, grpc.StatusCode.INVALID_ARGUMENT),  # empty prompt
        ({"prompt": "hi", "token_ids": [5], "max_new_tokens": 5}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": [5, 1000], "max_new_tokens": 5}, grpc.StatusCode.INVALID_ARGUMENT),  # vocab is 1000
        ({"token_ids": [5, -1], "max_new_tokens": 5}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": [5] * 2100, "max_new_tokens": 5}, grpc.StatusCode.OUT_OF_RANGE),  # context is 2048
        ({"token_ids": [5, 6], "max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": [5, 6], "max_new_tokens": -3}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": [5, 6], "max_new_tokens": 2_000_000_000}, grpc.StatusCode.OUT_OF_RANGE),
        ({"token_ids": [5, 6], "max_new_tokens": 5, "temperature": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": [5, 6], "max_new_tokens": 5, "top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"token_ids": [5, 6], "max_new_tokens": 5, "stop": [""]}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_router_refuses_bad_requests_with_a_clear_status(mesh, request_fields, code):
    stub = mesh.router_stub
    assert await status_of(stub.Generate(router_pb2.GenerateRequest(**request_fields), timeout=10)) == code
    ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=3)))
    assert len(ids) >= 1  # still serving


async def open_session(stub, session_id: str, max_length: int = 16):
    await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id=session_id, max_length=max_length))


def step(session_id: str, start: int = 0, *, ids=None, hidden=None) -> stage_pb2.ForwardRequest:
    request = stage_pb2.ForwardRequest(session_id=session_id, start=start)
    if ids is not None:
        request.token_ids.CopyFrom(tensor_codec.encode(torch.tensor(ids)))
    if hidden is not None:
        request.hidden.CopyFrom(tensor_codec.encode(hidden))
    return request


async def test_second_stage_refuses_wrong_hidden_shape(mesh):
    stub = mesh.stage_stub(0, 1)
    await open_session(stub, "shape")
    assert await step_status(stub, step("shape", hidden=torch.zeros(2, 255))) == grpc.StatusCode.INVALID_ARGUMENT
    assert await step_status(stub, step("shape2", hidden=torch.zeros(2, 256))) == grpc.StatusCode.NOT_FOUND


async def test_second_stage_refuses_wrong_dtype_and_token_ids(mesh):
    stub = mesh.stage_stub(0, 1)
    for i, bad in enumerate([step("d0", hidden=torch.zeros(2, 256, dtype=torch.int64)), step("d1", ids=[5, 6])]):
        await open_session(stub, f"d{i}")
        assert await step_status(stub, bad) == grpc.StatusCode.INVALID_ARGUMENT


async def test_stage_refuses_malformed_tensor_bytes(mesh):
    stub = mesh.stage_stub(0, 1)
    await open_session(stub, "bytes")
    seven_bytes_for_512_floats = tensor_pb2.Tensor(dtype="float32", shape=[2, 256], data=b"\x00" * 7)
    broken = stage_pb2.ForwardRequest(session_id="bytes", start=0, hidden=seven_bytes_for_512_floats)
    assert await step_status(stub, broken) == grpc.StatusCode.INVALID_ARGUMENT


async def test_first_stage_refuses_ids_outside_vocab_and_wrong_positions(mesh):
    stub = mesh.stage_stub(0, 0)
    await open_session(stub, "vocab")
    assert await step_status(stub, step("vocab", ids=[3, 1000])) == grpc.StatusCode.INVALID_ARGUMENT
    await open_session(stub, "pos")
    assert await step_status(stub, step("pos", start=4, ids=[3])) == grpc.StatusCode.INVALID_ARGUMENT
    await open_session(stub, "long", max_length=4)
    assert await step_status(stub, step("long", ids=[3] * 5)) == grpc.StatusCode.OUT_OF_RANGE


async def test_stage_session_errors(mesh):
    stub = mesh.stage_stub(0, 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await open_session(stub, "huge", max_length=10**6)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    await open_session(stub, "twice")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await open_session(stub, "twice")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="never-opened"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="twice"))


async def test_full_kv_pool_refuses_new_sessions_at_once(tiny_model):
    # 4 blocks: one session's look-ahead (4 blocks, below its max_length's 7) is the whole pool.
    small = await start_mesh(tiny_model, [splits(8)], router=False, stage_options={"kv_cache_gb": kv_gb_for_blocks(4)})
    stub = small.stage_stub(0, 0)
    try:
        await open_session(stub, "fits", max_length=100)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await open_session(stub, "does-not-fit", max_length=1)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--kv-cache-gb" in err.value.details()
    finally:
        await small.stop()


async def test_other_streams_keep_going_while_bad_input_arrives(mesh, hf_models):
    ids = list(range(10, 40))
    expected = hf_greedy(hf_models["llama"], ids, 48)
    good = asyncio.ensure_future(collect(mesh.router_stub.Generate(
        router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=48))))
    stub = mesh.stage_stub(0, 1)
    for i in range(10):
        await open_session(stub, f"noise{i}")
        await step_status(stub, step(f"noise{i}", hidden=torch.zeros(1, 3)))
        await status_of(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[99999], max_new_tokens=2)))
    got, _, _ = await good
    assert got == expected
