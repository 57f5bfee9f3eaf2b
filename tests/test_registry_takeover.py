"""The embedded registry cannot be taken over (issue 45): a client that is not the leader lock's holder can neither
delete nor overwrite the lock, nor learn the holder's id (the secret that renews and releases it); registrations
with a TTL of 1e9 or records of megabytes are refused. Against a real `stagemesh registry` process, through the raw
stubs (an attacker skips the client library's own checks)."""

from __future__ import annotations

import os
import secrets

import grpc
import pytest

from stagemesh.discovery.registry import leader_key
from stagemesh.launcher import LocalMesh
from stagemesh.v1 import registry_pb2, registry_pb2_grpc


@pytest.fixture
def registry_address(tmp_path):
    mesh = LocalMesh("", tmp_path)
    try:
        yield mesh.spawn("registry", ["registry", "--port", "0"], os.environ.copy()).address
    finally:
        mesh.shutdown()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_a_client_that_is_not_the_holder_cannot_delete_overwrite_or_learn_the_lock(registry_address):
    key = leader_key("m")
    holder = f"scheduler-1-{secrets.token_hex(16)}"
    with grpc.insecure_channel(registry_address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        assert stub.AcquireLock(registry_pb2.LockRequest(key=key, holder_id=holder, ttl_s=30), timeout=10).ok
        # The attacker: another client of the same registry.
        assert code_of(lambda: stub.KvDelete(registry_pb2.KvDeleteRequest(key=key), timeout=10)) == \
            grpc.StatusCode.FAILED_PRECONDITION
        assert code_of(lambda: stub.KvPut(registry_pb2.KvPutRequest(key=key, value=b"mine"), timeout=10)) == \
            grpc.StatusCode.FAILED_PRECONDITION
        assert code_of(lambda: stub.KvPut(registry_pb2.KvPutRequest(key=key, value=b"mine", cas_index=0),
                                          timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
        answers = [stub.LockHolder(registry_pb2.LockHolderRequest(key=key), timeout=10),
                   stub.KvGet(registry_pb2.KvGetRequest(key=key), timeout=10),
                   stub.KvList(registry_pb2.KvListRequest(prefix="stagemesh/"), timeout=10)]
        for answer in answers:
            assert holder.encode() not in answer.SerializeToString(), type(answer).__name__
        assert answers[0].held and answers[0].holder_name
        thief = f"attacker-{secrets.token_hex(16)}"
        assert not stub.AcquireLock(registry_pb2.LockRequest(key=key, holder_id=thief, ttl_s=30), timeout=10).ok
        assert not stub.RenewLock(registry_pb2.LockRequest(key=key, holder_id=thief), timeout=10).ok
        assert not stub.ReleaseLock(registry_pb2.LockRequest(key=key, holder_id=thief), timeout=10).ok
        assert stub.LockHolder(registry_pb2.LockHolderRequest(key=key), timeout=10).held
        # The holder still holds it, renews it and releases it; then the key is an ordinary key again.
        assert stub.RenewLock(registry_pb2.LockRequest(key=key, holder_id=holder), timeout=10).ok
        assert stub.ReleaseLock(registry_pb2.LockRequest(key=key, holder_id=holder), timeout=10).ok
        assert not stub.LockHolder(registry_pb2.LockHolderRequest(key=key), timeout=10).held
        stub.KvPut(registry_pb2.KvPutRequest(key=key, value=b"free"), timeout=10)
        stub.KvDelete(registry_pb2.KvDeleteRequest(key=key), timeout=10)
        # A holder id short enough to guess is no secret.
        assert code_of(lambda: stub.AcquireLock(registry_pb2.LockRequest(key=key, holder_id="a", ttl_s=30),
                                                timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT


def record(**fields) -> registry_pb2.ServiceRecord:
    return registry_pb2.ServiceRecord(**{"service_id": "stage-x", "address": "127.0.0.1:50061", "model": "m",
                                         **fields})


def test_registrations_with_huge_ttls_or_records_are_refused(registry_address):
    with grpc.insecure_channel(registry_address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        register = stub.Register
        for request in (registry_pb2.RegisterRequest(record=record(), ttl_s=1e9),
                        registry_pb2.RegisterRequest(record=record(), ttl_s=2, deregister_after_s=1e9),
                        registry_pb2.RegisterRequest(record=record(), ttl_s=float("nan")),
                        registry_pb2.RegisterRequest(record=record(model="m" * 300_000), ttl_s=2),
                        registry_pb2.RegisterRequest(record=record(service_id="s" * 300_000), ttl_s=2)):
            assert code_of(lambda r=request: register(r, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        # 10 MiB: refused by its length prefix before it is read (the registry's message limit), not parsed.
        huge = registry_pb2.RegisterRequest(record=record(meta={"x": "v" * (10 << 20)}), ttl_s=2)
        assert code_of(lambda: register(huge, timeout=10)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code_of(lambda: stub.AcquireLock(registry_pb2.LockRequest(
            key=leader_key("m"), holder_id=secrets.token_hex(16), ttl_s=1e9), timeout=10)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert not stub.ListServices(registry_pb2.ListServicesRequest(), timeout=10).services
        register(registry_pb2.RegisterRequest(record=record(), ttl_s=2), timeout=10)  # an honest one still is
        assert [s.record.service_id for s in stub.ListServices(registry_pb2.ListServicesRequest(),
                                                                timeout=10).services] == ["stage-x"]
