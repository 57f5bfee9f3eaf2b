"""Drain, as real processes: SIGTERM to a stage that carries streams lets them finish on it (no failover and no
repair in the router's counters, exact tokens) and the process exits by itself, with status 0, once they have
finished: well before its drain timeout, which would have cut them."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from stagemesh.launcher import start_local_mesh, wait_for_chains
from stagemesh.stage_server.server import SERVICE_NAME as STAGE_SERVICE
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import hf_greedy
from tests.harness.fault_mesh import free_ports

DRAIN_S = 60.0
"""Far more than the streams need (~3 s here), so that on a slow machine the drain still lets them finish; a
process that exits within it exited because its streams had ended, not because the timeout cut them."""
MARGIN_S = 30.0
STREAMS = 6
TOKENS = 64
PACE_MS = 20
"""--batch-window-ms: every step waits this long at each stage, so that 64 tokens take >= 2.5 s on any
machine and the streams are surely mid-flight when the SIGTERM lands."""


class Stream(threading.Thread):
    """One greedy Generate call, read token by token."""

    def __init__(self, address: str, prompt: list[int], request_id: str):
        super().__init__(daemon=True)
        self.address, self.prompt, self.request_id = address, prompt, request_id
        self.tokens: list[int] = []
        self.finished = False
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        request = router_pb2.GenerateRequest(token_ids=self.prompt, max_new_tokens=TOKENS, temperature=0.0,
                                             request_id=self.request_id)
        try:
            with grpc.insecure_channel(self.address) as channel:
                for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=DRAIN_S + MARGIN_S):
                    self.tokens.extend(response.token_ids)
            self.finished = True
        except grpc.RpcError as exc:
            self.error = exc


class HttpStream(Stream):
    """The same greedy request through the router's OpenAI-compatible HTTP front, streamed."""

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True,
                "return_token_ids": True}
        try:
            with httpx.stream("POST", f"{self.address}/v1/completions", json=body, timeout=DRAIN_S + MARGIN_S,
                              headers={"x-request-id": self.request_id}) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.finished = True
                    elif line.startswith("data: "):
                        self.tokens.extend(t for c in json.loads(line[6:])["choices"] for t in c["token_ids"])
        except httpx.HTTPError as exc:
            self.error = exc


def open_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10).open_sessions


def stage_health(address: str) -> int | None:
    """The stage's health for its Stage service (NOT_SERVING while it drains); None once it does not answer."""
    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=STAGE_SERVICE),
                                                             timeout=10).status
    except grpc.RpcError:
        return None


def router_counter(port: int, name: str) -> float:
    """A counter of the router's /metrics (0 before it is first counted)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == f"{name}_total")


def moved_streams(port: int) -> float:
    """Streams the router moved off a chain (failed over) or kept on it past a failed stage (repaired)."""
    return router_counter(port, "stagemesh_router_failovers") + router_counter(port, "stagemesh_router_repairs")


PROMPTS = [[5 + i, 17, 42, 9 + 3 * i, 100 + i] for i in range(STREAMS)]


@pytest.fixture(scope="module")
def expected(hf_models):
    return [hf_greedy(hf_models["llama"], p, TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("drain")
    metrics_port, http_port = free_ports(2)
    mesh, router = start_local_mesh(
        str(tiny_model), stages=2, replicas=2, router_port=0, registry="local", threads=1, log_dir=log_dir,
        extra_stage_args=["--drain-timeout-s", str(DRAIN_S), "--batch-window-ms", str(PACE_MS)],
        extra_router_args=["--drain-timeout-s", str(DRAIN_S), "--metrics-port", str(metrics_port),
                           "--http-port", str(http_port)])
    router.http_url = f"http://127.0.0.1:{http_port}"
    try:
        assert len(wait_for_chains(router.address, 2, timeout=120)) == 2, "the mesh did not come up with 2 chains"
        yield mesh, router, metrics_port
    finally:
        mesh.stop()


def start_streams(router: str, tag: str, http: str | None = None) -> list[Stream]:
    """STREAMS greedy streams, returned once each has a couple of tokens (all are mid-flight then); with http (the
    router's HTTP front), every other one through it."""
    streams = [HttpStream(http, p, f"{tag}-{i}") if http and i % 2 else Stream(router, p, f"{tag}-{i}")
               for i, p in enumerate(PROMPTS)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while not all(len(s.tokens) >= 2 or s.finished or s.error for s in streams):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.02)
    return streams


def finish(streams: list[Stream], expected: list[list[int]]) -> None:
    """Every stream ended without an error, with exactly transformers' tokens."""
    for s in streams:
        s.join(timeout=DRAIN_S + MARGIN_S)
    assert not [s.request_id for s in streams if s.is_alive()], "streams still running"
    assert [(s.request_id, s.error) for s in streams if s.error] == []
    for s, want in zip(streams, expected, strict=True):
        assert s.finished and s.tokens == want, s.request_id


def errors_in(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if '"level": "error"' in line or "Traceback" in line]


def test_sigterm_drains_a_stage_its_streams_finish_exactly_and_it_exits(mesh, expected):
    mesh, router, metrics_port = mesh
    chains = wait_for_chains(router.address, 2, timeout=10)
    moved = moved_streams(metrics_port)
    streams = start_streams(router.address, "stage-drain")
    # The victim: a stage that holds sessions right now (the router spreads the streams over both chains).
    stages = [s.address for c in chains for s in c.stages]
    loaded = {a: open_sessions(a) for a in stages}
    victim_address = max(stages, key=loaded.get)
    assert loaded[victim_address] >= 1, loaded
    victim = next(p for p in mesh.processes if p.address == victim_address)
    t0 = time.monotonic()
    victim.popen.send_signal(signal.SIGTERM)
    assert not [s.request_id for s in streams if s.finished], "every stream is mid-flight at the SIGTERM"
    deadline = time.monotonic() + DRAIN_S
    while (health := stage_health(victim_address)) == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the stage went on SERVING after its SIGTERM"
        time.sleep(0.02)
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING, "draining: it answers, and takes no new session"
    assert not [s.request_id for s in streams if s.finished], "it drains while its streams go on"

    finish(streams, expected)
    returncode = victim.popen.wait(timeout=DRAIN_S + MARGIN_S)
    took = time.monotonic() - t0
    assert returncode == 0, f"the drained stage exited with {returncode} (negative: killed by a signal)"
    assert took < DRAIN_S, f"it exited {took:.1f}s after its SIGTERM: at its drain timeout, not when its streams ended"
    # Drained, not failed over nor repaired: the router moved no stream off the stopping stage.
    assert moved_streams(metrics_port) == moved
    assert not errors_in(mesh.log_dir / "router.log")
    assert not errors_in(victim.log_path)
    # The rest of the mesh still serves.
    with grpc.insecure_channel(router.address) as channel:
        ids = [t for r in router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(token_ids=PROMPTS[0], max_new_tokens=8), timeout=60) for t in r.token_ids]
    assert ids == expected[0][:8]
    assert moved_streams(metrics_port) == moved


def test_sigterm_drains_the_router_its_streams_finish_exactly_and_it_exits(mesh, expected):
    mesh, router, _ = mesh
    streams = start_streams(router.address, "router-drain", http=router.http_url)  # both front doors drain
    t0 = time.monotonic()
    router.popen.send_signal(signal.SIGTERM)
    assert not [s.request_id for s in streams if s.finished], "every stream is mid-flight at the SIGTERM"
    finish(streams, expected)
    assert router.popen.wait(timeout=DRAIN_S + MARGIN_S) == 0
    took = time.monotonic() - t0
    assert took < DRAIN_S, f"it exited {took:.1f}s after its SIGTERM: at its drain timeout, not when its streams ended"
    assert not errors_in(router.log_path)
    with pytest.raises(grpc.RpcError) as err, grpc.insecure_channel(router.address) as channel:
        list(router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(token_ids=[5], max_new_tokens=2),
                                                          timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, "the router is gone"
