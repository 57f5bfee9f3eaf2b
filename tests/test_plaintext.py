"""Plaintext off loopback is refused (issue 45): a stage or router bound to a routable address, or dialling one,
without --tls exits with a message naming --tls and --insecure; with --insecure it starts; loopback is unchanged.
Binding 0.0.0.0 counts as off loopback; the tests send traffic to 127.0.0.1 only."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.launcher import READY, LocalMesh
from stagemesh.v1 import stage_pb2
from tests.conftest import start_mesh

EXIT_TIMEOUT_S = 120.0
"""A refused process exits after its imports and flag parsing: seconds, with a wide margin for a loaded machine."""


def refusal(*args: str) -> subprocess.CompletedProcess:
    """How `stagemesh ARGS` ended: its exit, or (returncode None) its ready line, after which it is stopped."""
    popen = subprocess.Popen([sys.executable, "-m", "stagemesh.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    watchdog = threading.Timer(EXIT_TIMEOUT_S, popen.kill)  # neither exit nor ready line: the read below ends
    watchdog.start()
    try:
        for line in popen.stdout:  # ends at its exit; a process that starts prints its ready line
            if READY.search(line):
                popen.terminate()
                return subprocess.CompletedProcess(args, None, "", f"started: {line}")
        return subprocess.CompletedProcess(args, popen.wait(EXIT_TIMEOUT_S), "", popen.stderr.read())
    finally:
        watchdog.cancel()
        if popen.poll() is None:
            popen.kill()
        popen.wait(EXIT_TIMEOUT_S)
        popen.stdout.close()
        popen.stderr.close()


def assert_refused(result: subprocess.CompletedProcess, address: str) -> None:
    assert result.returncode not in (None, 0), result.stderr
    assert "--tls" in result.stderr and "--insecure" in result.stderr and address in result.stderr, result.stderr


def answers_health(port: str) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    return True


def test_a_stage_and_a_router_off_loopback_without_tls_refuse_to_start_and_start_with_insecure(tiny_model, tmp_path):
    stage = ["stage", "--model", str(tiny_model), "--layers", "0:8", "--host", "0.0.0.0", "--advertise",
             "127.0.0.1", "--port", "0", "--kv-cache-gb", "0.05"]
    assert_refused(refusal(*stage), "0.0.0.0")
    mesh = LocalMesh(str(tiny_model), tmp_path)
    try:
        started = mesh.spawn("stage-0", [*stage, "--insecure"], os.environ.copy())
        stage_port = started.address.rpartition(":")[2]
        assert answers_health(stage_port)
        router = ["router", "--model", str(tiny_model), "--chain", f"127.0.0.1:{stage_port}", "--host", "0.0.0.0",
                  "--port", "0"]
        assert_refused(refusal(*router), "0.0.0.0")
        tokens = tmp_path / "tokens.json"
        tokens.write_text('{"tokens": [{"name": "a", "token": "t"}]}')
        result = refusal(*router, "--auth-tokens", str(tokens))
        assert_refused(result, "0.0.0.0")
        assert "--auth-tokens" in result.stderr
        routed = mesh.spawn("router", [*router, "--insecure"], os.environ.copy())
        assert answers_health(routed.address.rpartition(":")[2])
    finally:
        mesh.shutdown()


def test_dialled_addresses_off_loopback_are_refused_too():
    """A router's chain, a stage's registry, an etcd or Consul: the dialled side, refused before any import of
    the model (the same rule, checked where the config is built)."""
    assert_refused(refusal("router", "--model", "m", "--chain", "127.0.0.1:1,192.0.2.7:50061"), "192.0.2.7:50061")
    assert_refused(refusal("stage", "--model", "m", "--registry", "local://192.0.2.7:50050"), "192.0.2.7:50050")
    assert_refused(refusal("scheduler", "--model", "m", "--registry", "etcd://192.0.2.7:2379"), "192.0.2.7:2379")


async def test_a_plaintext_stage_does_not_forward_to_a_next_stage_off_loopback(tiny_model):
    """A router (anyone, over plaintext) naming a next_address elsewhere would have the stage probe its network
    and send hidden states in the clear: refused, while a loopback next stage is accepted."""
    mesh = await start_mesh(tiny_model, [[(0, 4), (4, 8)]], router=False)
    try:
        stub = mesh.stage_stub(0, 0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="out", max_length=16,
                                                                next_address="192.0.2.7:50061"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--insecure" in err.value.details()
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="in", max_length=16,
                                                            next_address=mesh.stages[0][1].address))
    finally:
        await mesh.stop()
