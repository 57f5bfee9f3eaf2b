"""Length-aware routing on real meshes (stage servers and a router on loopback, with a registry and a scheduler
where stages announce their tp): short prompts go to replicas, long ones to the widest chain, either falls back to
any usable chain when its kind is down or full, the metrics count both paths, and every path gives transformers'
greedy tokens. And the scheduler's plan, as `stagemesh plan` prints it, advises --tp on a machine of two devices."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from stagemesh import grpc_server
from stagemesh.discovery.backends import open_registry
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.chains import ChainSet
from stagemesh.router.priority_queue import AdmissionConfig
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.scheduler.server import print_plan
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.server import StageServer
from stagemesh.stage_server.service.registration import Registration, RegistrationConfig
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import router_pb2, router_pb2_grpc
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.test_scheduler import ControlPlane, wait_for_chains

ROOT = Path(__file__).resolve().parent.parent

LONG_PROMPT_TOKENS = 16
SHORT = list(range(3, 11))  # 8 tokens
LONG = [(7 * i) % 900 + 3 for i in range(40)]  # 40 tokens


class DevicePlane(ControlPlane):
    async def add_stage(self, share_of_model: float, tp: int = 1, host_id: str = "m1", devices: int = 1):
        """A stage whose budget holds this share of the model; `tp` is announced only (the scheduler and
        routers treat it as a tensor-parallel group of that many ranks)."""
        budget = int(self.footprint.total_bytes * share_of_model / 0.8)
        server = StageServer(StageConfig(model=str(self.model), registry=self.url, port=0, kv_cache_gb=0.5, tp=tp,
                                         host_id=host_id, devices=devices))
        await server.start()
        registration = Registration(server, open_registry(self.url),
                                    RegistrationConfig(self.model.name, budget, ttl_s=1.0, host_id=host_id,
                                                       devices=devices), fixed=False)
        await registration.start()
        self.stages.append((server, registration))
        return server

    async def add_router(self, **options) -> router_pb2_grpc.RouterStub:
        self.router = RouterServer(RouterConfig(model=str(self.model), registry=self.url, port=0,
                                                health_interval_s=0.2, long_prompt_tokens=LONG_PROMPT_TOKENS,
                                                **options))
        await self.router.start()
        channel = grpc_server.insecure_channel(self.router.address)
        self.closers.append(channel.close)
        return router_pb2_grpc.RouterStub(channel)


def routed(length_class: str, path: str) -> float:
    return REGISTRY.get_sample_value("stagemesh_router_routed_total", {"class": length_class, "path": path}) or 0.0


async def kind_serving(stub, prompt: list[int], new_tokens: int = 400):
    """Starts a stream, reads its first token, and answers (the kind of the chain it is on, the open call)."""
    call = stub.Generate(router_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=new_tokens))
    first = await call.read()
    assert first.token_ids
    chains = (await stub.ListChains(router_pb2.ListChainsRequest())).chains
    busy = [c.kind for c in chains if c.in_flight]
    return busy, call


async def read_rest(call) -> list[int]:
    ids = []
    while (response := await call.read()) is not grpc.aio.EOF:
        ids.extend(response.token_ids)
    return ids


async def greedy(stub, prompt: list[int], new_tokens: int = 24) -> list[int]:
    ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=new_tokens)))
    return ids


def test_pick_ranks_kinds_by_prompt_length_and_falls_back_when_full():
    def chain(name: str, *tps: int) -> Chain:
        return Chain([StageEndpoint(f"{name}:{i}", tp=tp) for i, tp in enumerate(tps)], chain_id=name)

    replica, pipeline, tp2, tp4_pipeline = chain("r", 1), chain("p", 1, 1), chain("t", 2), chain("w", 4, 4)
    chains = ChainSet([replica, pipeline, tp2, tp4_pipeline], 8, "", long_prompt_tokens=512, slots_per_chain=2)
    assert chains.pick(prompt_tokens=512) is replica and chains.pick(prompt_tokens=513) is tp4_pipeline
    assert [chains.length_class_of(c) for c in chains.chains] == ["short", "", "", "long"]
    replica.in_flight = 2  # full: the least loaded of all takes the short prompt
    assert chains.pick(prompt_tokens=10) is pipeline
    assert chains.pick(prompt_tokens=10, exclude={"p"}) is tp2
    tp4_pipeline.healthy = False  # down, still known: long prompts fall back rather than rank the tp-2 chain first
    fallbacks = routed("long", "fallback")
    assert chains.pick(prompt_tokens=4000) is pipeline and routed("long", "fallback") == fallbacks + 1
    chains.chains.remove(tp4_pipeline)  # withdrawn: the tp-2 chain is the widest now
    assert chains.pick(prompt_tokens=4000) is tp2
    off = ChainSet([replica, tp2], 8, "", long_prompt_tokens=0)
    assert off.pick(prompt_tokens=4000) is tp2 and {off.length_class_of(c) for c in off.chains} == {"any"}


async def test_short_prompts_to_the_replica_long_to_the_pipeline_and_fallback(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(8), splits(4, 4)],
                            router_options={"long_prompt_tokens": LONG_PROMPT_TOKENS})
    try:
        stub = mesh.router_stub
        chains = await wait_for_chains(stub, lambda c: len(c) == 2)
        assert sorted((c.kind, c.tp_width, c.length_class) for c in chains) == [
            ("pipeline", 1, "long"), ("replica", 1, "short")]

        for prompt, want, length_class in ((SHORT, ["replica"], "short"), (LONG, ["pipeline"], "long")):
            before = routed(length_class, "preferred")
            busy, call = await kind_serving(stub, prompt)
            assert busy == want and routed(length_class, "preferred") == before + 1
            call.cancel()
            await wait_idle(stub)
        for prompt in (SHORT, LONG):
            assert await greedy(stub, prompt) == hf_greedy(hf_models["llama"], prompt, 24)

        # The replica's stage dies: short prompts fall back to the pipeline, counted as such, token-exact.
        await mesh.stages[0][0].stop(0)
        await wait_for_chains(stub, lambda c: [x.kind for x in c] == ["pipeline"])
        fallbacks = routed("short", "fallback")
        assert await greedy(stub, SHORT) == hf_greedy(hf_models["llama"], SHORT, 24)
        assert routed("short", "fallback") == fallbacks + 1
    finally:
        await mesh.stop()


async def test_long_prompts_to_the_tp_chain_and_short_ones_fall_back_when_replicas_are_full(tiny_model, hf_models):
    mesh = await DevicePlane(tiny_model).start()
    try:
        await mesh.add_scheduler()
        await mesh.add_stage(1.5)
        await mesh.add_stage(3.0, tp=2, host_id="m2", devices=2)
        stub = await mesh.add_router(admission=AdmissionConfig(slots_per_chain=1))
        chains = await wait_for_chains(stub, lambda c: len(c) == 2)
        assert sorted((c.kind, c.tp_width, c.length_class) for c in chains) == [
            ("replica", 1, "short"), ("tp", 2, "long")]
        printed = await print_plan(mesh.url, tiny_model.name)
        assert "(tp)" in printed and "(tp, tp width 2" in printed and "(replica, tp width 1" in printed
        assert "advice" not in printed  # the mesh has its tensor-parallel chain

        busy, long_call = await kind_serving(stub, LONG)
        assert busy == ["tp"]
        long_call.cancel()
        await wait_idle(stub)

        # One short stream holds the replica's only slot: the next short prompt falls back to the tp chain.
        busy, held = await kind_serving(stub, SHORT, 2000)
        assert busy == ["replica"]
        fallbacks = routed("short", "fallback")
        # (long enough to be still streaming when the chains are listed, on a machine 10x slower or faster; the
        # tp chain usable first: on a loaded machine its two ranks may have missed a health check meanwhile)
        await wait_for_chains(stub, lambda c: len(c) == 2 and all(x.healthy for x in c))
        busy, second = await kind_serving(stub, SHORT[:6], 200)
        assert sorted(busy) == ["replica", "tp"] and routed("short", "fallback") == fallbacks + 1
        assert await read_rest(second) == hf_greedy(hf_models["llama"], SHORT[:6], 200)[1:]  # the first was read
        held.cancel()
    finally:
        await mesh.stop()


async def wait_idle(stub, timeout_s: float = 10.0) -> None:
    """Until no chain has a stream in flight (a cancelled call leaves its chain in the background)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        chains = (await stub.ListChains(router_pb2.ListChainsRequest())).chains
        if not any(c.in_flight for c in chains):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("streams still in flight")


async def test_plan_advises_tp_on_a_machine_with_two_devices(tiny_model):
    mesh = await DevicePlane(tiny_model).start()
    try:
        await mesh.add_scheduler()
        for _ in range(2):  # one rank each, on one machine of two devices: a pipeline inside it
            await mesh.add_stage(0.6, host_id="gpu-box", devices=2)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while "1 chain(s) published" not in (printed := await print_plan(mesh.url, tiny_model.name)):
            assert loop.time() < deadline, printed
            await asyncio.sleep(0.1)
        assert "advice for gpu-box: start a stage there with --tp 2" in printed
        assert "(pipeline, tp width 1" in printed
    finally:
        await mesh.stop()


@pytest.mark.timeout(960)
def test_bench_routing_quick_runs_and_writes_both_routers_figures(tmp_path):
    out = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_routing.py"), "--quick", "--out", str(out),
                           "--model", str(make_tiny_model(tmp_path / "model", "llama", max_position=1100)),
                           "--metrics-port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert sorted(c["kind"] for c in report["chains"]) == ["pipeline", "replica"]
    for mode in ("rule", "no rule"):
        assert {c: report["summary"][mode][c]["n"] for c in ("short", "long")} == {"short": 8, "long": 2}
    assert report["routed"]["rule"] == {"short/preferred": 8.0, "long/preferred": 2.0}
