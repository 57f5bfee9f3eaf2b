"""Shared fixtures: tiny checkpoints made on the spot, and real stage servers and routers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from stagemesh import grpc_transport  # noqa: F401, I001  (first of ours: gRPC's transport, as a service process sets it)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(2)

from stagemesh import grpc_server, tensor_codec  # noqa: E402
from stagemesh.router.chain_client import Chain, StageEndpoint  # noqa: E402
from stagemesh.router.chain_probe import ChainProbeConfig  # noqa: E402
from stagemesh.router.server import RouterConfig, RouterServer  # noqa: E402
from stagemesh.router.session import ChainSession  # noqa: E402
from stagemesh.router.step_values import Sampling  # noqa: E402
from stagemesh.stage_server.config import StageConfig  # noqa: E402
from stagemesh.stage_server.engine.kv_pool import KVPool, SessionCache  # noqa: E402
from stagemesh.stage_server.engine.model import StageModel, StepSlice  # noqa: E402
from stagemesh.stage_server.server import StageServer  # noqa: E402
from stagemesh.tiny_model import make_tiny_model  # noqa: E402
from stagemesh.v1 import router_pb2_grpc, stage_pb2, stage_pb2_grpc  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2")
NO_PROBES = ChainProbeConfig(probe_interval_s=0)
"""The routers of tests that count stage work exactly: no end-to-end chain probes (router/chain_probe.py)."""
NUM_LAYERS = 8


def pytest_addoption(parser) -> None:
    # scripts/gpu_check.sh runs tests/test_device_exactness.py with these on a CUDA machine.
    parser.addoption("--device", default="cpu", help="where test_device_exactness runs both sides: cpu or cuda")
    parser.addoption("--test-dtype", default="float32", help="test_device_exactness's dtype: float32 or bfloat16")
    parser.addoption("--test-model", default="", help="test_device_exactness's checkpoint (default: the tiny Llama)")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(root / f, f, layers=NUM_LAYERS, seed=7) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["llama"]


def splits(*sizes: int) -> list[tuple[int, int]]:
    """splits(2, 6) -> [(0, 2), (2, 8)]: stage layer ranges from their sizes."""
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


@dataclass
class Mesh:
    """Stage servers and a router, all real gRPC servers on 127.0.0.1, in this process."""

    stages: list[list[StageServer]] = field(default_factory=list)  # one list per chain
    router: RouterServer | None = None
    channels: list = field(default_factory=list)

    @property
    def router_stub(self) -> router_pb2_grpc.RouterStub:
        channel = grpc_server.insecure_channel(self.router.address)
        self.channels.append(channel)
        return router_pb2_grpc.RouterStub(channel)

    def stage_stub(self, chain: int, index: int) -> stage_pb2_grpc.StageStub:
        channel = grpc_server.insecure_channel(self.stages[chain][index].address)
        self.channels.append(channel)
        return stage_pb2_grpc.StageStub(channel)

    def all_stages(self) -> list[StageServer]:
        return [s for chain in self.stages for s in chain]

    async def settled_infos(self, within_s: float = 30.0) -> list[stage_pb2.StageInfo]:
        """Every stage's Info (chain by chain) once none holds a session or a KV block, or as they are when
        within_s runs out. A router closes a finished stream's sessions a moment after the stream ends (its
        closes are batched), so a test that reads the stages right after its streams must wait for it."""
        stubs = [self.stage_stub(c, i) for c, chain in enumerate(self.stages) for i in range(len(chain))]
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            infos = [await stub.Info(stage_pb2.InfoRequest(), timeout=10) for stub in stubs]
            idle = all(i.open_sessions == 0 and i.kv_blocks_used == 0 and i.kv_used_bytes == 0 for i in infos)
            if idle or asyncio.get_running_loop().time() > deadline:
                return infos
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for channel in self.channels:
            await channel.close()
        if self.router:
            await self.router.stop(0)
        for stage in self.all_stages():
            with contextlib.suppress(Exception):
                await stage.stop(0)


async def start_mesh(model: Path, chains: list[list[tuple[int, int]]], *, router: bool = True,
                     stage_options: dict | None = None, router_options: dict | None = None) -> Mesh:
    mesh = Mesh()
    try:
        for layout in chains:
            servers = []
            mesh.stages.append(servers)
            for start, end in layout:
                options = {"kv_cache_gb": 1.0, "port": 0, **(stage_options or {})}
                servers.append(StageServer(StageConfig(model=str(model), layer_start=start, layer_end=end,
                                                       **options)))
                await servers[-1].start(servers[-1].load(start, end))
        if router:
            specs = [",".join(s.address for s in servers) for servers in mesh.stages]
            # No end-to-end probes unless asked for: they are steps of their own, and tests count the stages'
            # passes, tokens and sessions exactly (tests/test_chain_health.py tests the probes).
            options = {"probe": NO_PROBES, **(router_options or {})}
            mesh.router = RouterServer(RouterConfig(model=str(model), chains=specs, port=0, health_interval_s=0.2,
                                                    **options))
            await mesh.router.start()
    except BaseException:
        await mesh.stop()  # a grpc.aio server left alive hangs the interpreter's exit, after the last test
        raise
    return mesh


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    from transformers import AutoModelForCausalLM

    return {f: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for f, p in tiny_models.items()}


def decode_passes_match_transformers(model: StageModel, hf, pool: KVPool, seqs: list[list[int]],
                                     batches: list[list[int]], device: str = "cpu") -> list[SessionCache]:
    """In process, no server: a session per prompt in seqs, prefilled together in one eager pass, then decoded in
    one pass per batch (indices into seqs, in row order). Every prompt's and every step's logits within 1e-4 of
    transformers' forward pass over its session's tokens, and each step's greedy token the same; each prompt grows
    by its tokens. Returns the sessions' caches."""
    caches = [pool.allocate(64) for _ in seqs]
    steps, offset = [], 0
    for cache, ids in zip(caches, seqs, strict=True):
        pool.grow(cache, len(ids))
        steps.append(StepSlice(cache, offset, 0, len(ids)))
        offset += len(ids)
    out = model(torch.tensor([t for ids in seqs for t in ids], device=device), steps)
    with torch.inference_mode():
        for ids, row in zip(seqs, out, strict=True):
            torch.testing.assert_close(row, hf(torch.tensor([ids], device=device)).logits[0, -1], atol=1e-4, rtol=0)
            ids.append(int(row.argmax()))
    for batch in batches:
        steps = []
        for i, s in enumerate(batch):
            pool.grow(caches[s], caches[s].length + 1)
            steps.append(StepSlice(caches[s], i, caches[s].length, 1))
        out = model(torch.tensor([seqs[s][-1] for s in batch], device=device), steps)  # one decode pass
        with torch.inference_mode():
            for s, row in zip(batch, out, strict=True):
                ref = hf(torch.tensor([seqs[s]], device=device)).logits[0, -1]
                torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)
                assert int(row.argmax()) == int(ref.argmax())
                seqs[s].append(int(row.argmax()))
    return caches


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' generate() on the whole model in one process."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


async def stepped_logits(addresses: list[str], ids: list[int], steps: int,
                         request_id: str) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy steps on a chain of these stages through a ChainSession, logits asked for: (the new tokens,
    each step's logits), to hold against transformers' forward pass over prompt + new tokens."""
    chain = Chain([StageEndpoint(a) for a in addresses])
    logits, tokens = [], []
    try:
        async with ChainSession(chain, max_length=64, request_id=request_id) as session:
            feed = ids
            for _ in range(steps):
                response = await session.step(feed, sampling=Sampling(), return_logits=True)
                logits.append(tensor_codec.decode(response.logits))
                tokens.append(response.token_id)
                feed = [response.token_id]
    finally:
        for stage in chain.stages:
            await stage.close()
    return tokens, logits


async def collect(stream) -> tuple[list[int], str, list]:
    ids, text, responses = [], "", []
    async for r in stream:
        ids.extend(r.token_ids)
        text += r.text
        responses.append(r)
    return ids, text, responses


async def until(condition, timeout: float, what: str, every: float = 0.01) -> float:
    """Polls condition() until it holds (at most `timeout` seconds); returns when it did."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / every) + 1):
        if condition():
            return time.monotonic()
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s")


class StageSessions:
    """A test's own Stage/Sessions call to one stage, as a router's (no router): batches written, the stage's events
    read. A session's fault is raised as the grpc.aio.AioRpcError a call of its own would have ended with."""

    def __init__(self, stub: stage_pb2_grpc.StageStub, timeout: float | None = 60.0):
        self.call = stub.Sessions(timeout=timeout)

    async def send(self, *, opens=(), steps=(), close=(), reroute=()) -> None:
        await self.call.write(stage_pb2.SessionBatch(opens=opens, steps=steps, close=close, reroute=reroute))

    async def read(self, want: int = 1, within_s: float = 30.0) -> list[stage_pb2.ForwardResponse]:
        """The next `want` results (sessions opened: their ids, as results with only session_id set); the first
        fault heard is raised."""
        got: list[stage_pb2.ForwardResponse] = []
        async with asyncio.timeout(within_s):
            while len(got) < want:
                events = await self.call.read()
                if events is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(await self.call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details=await self.call.details())
                for fault in events.faults:
                    code = next(c for c in grpc.StatusCode if c.value[0] == fault.code)
                    raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=fault.details)
                got.extend(stage_pb2.ForwardResponse(session_id=sid) for sid in events.opened)
                got.extend(events.results)
        return got

    def cancel(self) -> None:
        self.call.cancel()


async def step_error(stub: stage_pb2_grpc.StageStub, *steps: stage_pb2.ForwardRequest) -> grpc.aio.AioRpcError:
    """Steps sessions opened on this stub's connection on a Sessions call of their own; the first fault heard (every
    refusal says what was wrong)."""
    stream = StageSessions(stub)
    try:
        await stream.send(steps=steps)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read(len(steps))
    finally:
        stream.cancel()
    assert err.value.details()
    return err.value


async def step_status(stub: stage_pb2_grpc.StageStub, *steps: stage_pb2.ForwardRequest) -> grpc.StatusCode:
    return (await step_error(stub, *steps)).code()


async def call_status(call) -> grpc.StatusCode:
    """The status a call ended with (OK when it got through)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
