"""A client with no stubs of ours reaches the mesh through server reflection alone, as grpcurl does."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.conftest import splits, start_mesh

ROUTER = "stagemesh.v1.Router"
STAGE = "stagemesh.v1.Stage"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


@pytest.fixture(scope="module")
async def mesh(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    yield mesh
    await mesh.stop()


class Reflected:
    """What a stub-less client learns from one server: its services and their descriptors.

    The reflection database is synchronous: use it only from a worker thread (asyncio.to_thread),
    never on the event loop that runs the servers.
    """

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.db = ProtoReflectionDescriptorDatabase(self.channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def services(self) -> list[str]:
        return list(self.db.get_services())

    def method(self, full_name: str):
        """The method's descriptor, looked up by its own name as `grpcurl describe` does."""
        return self.pool.FindMethodByName(full_name)

    def classes(self, full_name: str):
        method = self.method(full_name)
        return message_factory.GetMessageClass(method.input_type), message_factory.GetMessageClass(method.output_type)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture(scope="module")
async def router(mesh):
    reflected = await asyncio.to_thread(Reflected, mesh.router.address)
    yield reflected
    reflected.close()


@pytest.fixture(scope="module")
async def stage(mesh):
    reflected = await asyncio.to_thread(Reflected, mesh.stages[0][0].address)
    yield reflected
    reflected.close()


def path(method) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


async def test_router_lists_its_services(router):
    """Router, health and reflection itself are all discoverable."""
    services = await asyncio.to_thread(router.services)
    assert {ROUTER, HEALTH, REFLECTION} <= set(services)
    assert STAGE not in services


async def test_generate_is_server_streaming(router):
    """Generate is found by name and described as request in, stream out."""
    method = await asyncio.to_thread(router.method, f"{ROUTER}.Generate")
    assert method.full_name == f"{ROUTER}.Generate"
    assert method.server_streaming and not method.client_streaming
    assert method.input_type.full_name == "stagemesh.v1.GenerateRequest"
    assert method.output_type.full_name == "stagemesh.v1.GenerateResponse"
    assert method.containing_service.file.name == "stagemesh/v1/router.proto"
    assert method.containing_service.file.pool is router.pool  # from reflection, not our stubs


async def test_request_built_from_json(router):
    """A GenerateRequest can be made from grpcurl-style JSON with camelCase names."""
    request_class, _ = await asyncio.to_thread(router.classes, f"{ROUTER}.Generate")
    request = json_format.Parse('{"prompt": "hello", "maxNewTokens": 5}', request_class())
    assert request.prompt == "hello"
    assert request.max_new_tokens == 5
    with pytest.raises(json_format.ParseError):
        json_format.Parse('{"prompt": "hello", "maxTokens": 5}', request_class())


async def test_generate_streams_through_reflected_types(router):
    """Generate over a plain channel with reflected types streams 5 tokens and ends with a finish reason."""
    method = await asyncio.to_thread(router.method, f"{ROUTER}.Generate")
    request_class, response_class = await asyncio.to_thread(router.classes, f"{ROUTER}.Generate")
    request = json_format.Parse('{"prompt": "hello", "maxNewTokens": 5}', request_class())
    async with grpc.aio.insecure_channel(router.address) as channel:
        call = channel.unary_stream(path(method), request_serializer=request_class.SerializeToString,
                                    response_deserializer=response_class.FromString)
        responses = [r async for r in call(request, timeout=60)]
    assert responses
    assert sum(len(r.token_ids) for r in responses) == 5
    last = json_format.MessageToDict(responses[-1])
    assert last["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert all("finishReason" not in json_format.MessageToDict(r) for r in responses[:-1])


async def test_list_chains_through_reflected_types(router, mesh):
    """ListChains, called from JSON '{}', shows the one chain of two stages."""
    method = await asyncio.to_thread(router.method, f"{ROUTER}.ListChains")
    request_class, response_class = await asyncio.to_thread(router.classes, f"{ROUTER}.ListChains")
    async with grpc.aio.insecure_channel(router.address) as channel:
        call = channel.unary_unary(path(method), request_serializer=request_class.SerializeToString,
                                   response_deserializer=response_class.FromString)
        reply = json_format.MessageToDict(await call(json_format.Parse("{}", request_class()), timeout=10))
    [chain] = reply["chains"]
    assert [s["address"] for s in chain["stages"]] == [s.address for s in mesh.stages[0]]
    assert [(s.get("layerStart", 0), s["layerEnd"]) for s in chain["stages"]] == [(0, 4), (4, 8)]


async def test_stage_lists_its_services(stage):
    """A stage server offers Stage, health and reflection, and Sessions is a bidirectional stream."""
    services = await asyncio.to_thread(stage.services)
    assert {STAGE, HEALTH, REFLECTION} <= set(services)
    assert ROUTER not in services
    sessions = await asyncio.to_thread(stage.method, f"{STAGE}.Sessions")
    assert sessions.client_streaming and sessions.server_streaming
    info = await asyncio.to_thread(stage.method, f"{STAGE}.Info")
    assert not info.client_streaming and not info.server_streaming


def health_check(reflected: Reflected, service: str) -> str:
    """grpc.health.v1.Health/Check with reflected types, over the sync channel; returns the status name."""
    method = reflected.method(f"{HEALTH}.Check")
    request_class, response_class = reflected.classes(f"{HEALTH}.Check")
    call = reflected.channel.unary_unary(path(method), request_serializer=request_class.SerializeToString,
                                         response_deserializer=response_class.FromString)
    reply = call(json_format.Parse(f'{{"service": "{service}"}}', request_class()), timeout=10)
    return json_format.MessageToDict(reply, always_print_fields_with_no_presence=True)["status"]


def wait_serving(reflected: Reflected, service: str, timeout_s: float = 10.0) -> str:
    """The router turns SERVING once its first chain health check passes; give that a moment."""
    deadline = time.monotonic() + timeout_s
    while (status := health_check(reflected, service)) != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.05)
    return status


@pytest.mark.parametrize("service", ["", ROUTER])
async def test_router_health_is_serving(router, service):
    """Health Check on the router, overall and for stagemesh.v1.Router, answers SERVING."""
    assert await asyncio.to_thread(wait_serving, router, service) == "SERVING"


async def test_stage_health_is_serving(stage):
    """A started stage answers SERVING for stagemesh.v1.Stage."""
    assert await asyncio.to_thread(health_check, stage, STAGE) == "SERVING"


async def test_health_of_an_unknown_service_is_not_found(router):
    """A service the router does not serve is NOT_FOUND, not SERVING."""
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(health_check, router, "stagemesh.v1.Nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
