"""Backpressure, on stage processes: a peer that sends steps faster than it is served (a client that never reads
its answers, a next stage SIGSTOPped) leaves the stage's memory bounded, measured as the process's RSS, while the
stage's other sessions are served exactly; a session that closes leaves the stage's links.

The stages run with small queues (1 MiB, 16 steps) and each test pushes ~200 MiB at them: without the bounds the
stage reads and queues it all (its RSS grows by most of it); with them it stops reading its peer, whose writes then
wait on HTTP/2 flow control."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.launcher import LocalMesh, stage_env
from stagemesh.router.chain_client import Chain, Progress, StageEndpoint
from stagemesh.router.prefill_window import AHEAD_PER_STAGE
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.server import StageServer
from stagemesh.stage_server.server import log as server_log
from stagemesh.v1 import stage_pb2, stage_pb2_grpc
from tests.conftest import hf_greedy
from tests.test_exactness import prompt

QUEUES = ["--stream-queue-steps", "16", "--stream-queue-mb", "1", "--relay-queue-mb", "1"]
PUSHED_STEPS = 1600
STEP_POSITIONS = 128
"""A test pushes PUSHED_STEPS steps of STEP_POSITIONS positions (128 KiB of hidden states each on the tiny model,
~200 MiB in all)."""
BOUND = 96 << 20
"""RSS growth allowed: the queues' few MiB, gRPC's flow-control windows and the allocator's slack."""
HIDDEN = 256


@pytest.fixture(scope="module")
def stages(tiny_model, tmp_path_factory):
    """first (layers 0:4), slow (4:8: the one a test stops) and last (4:8): stage processes."""
    mesh = LocalMesh(str(tiny_model), tmp_path_factory.mktemp("logs"))
    common = ["stage", "--model", str(tiny_model), "--port", "0", "--threads", "1", "--kv-cache-gb", "0.05",
              "--no-prefix-cache", *QUEUES]
    try:
        procs = mesh.spawn_together([(name, [*common, "--layers", layers]) for name, layers in
                                     (("first", "0:4"), ("slow", "4:8"), ("last", "4:8"))], stage_env(1))
        yield dict(zip(("first", "slow", "last"), procs, strict=True))
    finally:
        for proc in mesh.processes:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        mesh.stop()


def rss(proc) -> int:
    """The process's resident set now (/proc/<pid>/status VmRSS), in bytes."""
    with open(f"/proc/{proc.popen.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def info(proc) -> stage_pb2.StageInfo:
    async with grpc.aio.insecure_channel(proc.address) as channel:
        return await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)


async def served_exactly(hf_models, first, last, seed: int, want: list[int] | None = None) -> None:
    """Another session, on its own streams, through first and last: exact against transformers (want: its
    reference, computed before any session is in flight: transformers blocks the event loop)."""
    ids = prompt(9, seed=seed)
    want = hf_greedy(hf_models["llama"], ids, 6) if want is None else want
    chain = Chain([StageEndpoint(first.address), StageEndpoint(last.address)])
    try:
        async with ChainSession(chain, 64, f"bystander-{seed}") as session:
            tokens = [(await session.step(ids, sampling=Sampling())).token_id]
            for _ in range(5):
                tokens.append((await session.step(tokens[-1:], sampling=Sampling())).token_id)
        assert tokens == want
    finally:
        for stage in chain.stages:
            await stage.close()


class Hog:
    """A Sessions stream that opens one session and pushes steps at it (each followed by a rewind
    to 0, so the session never fills), never reading an answer."""

    def __init__(self, proc, open_request: stage_pb2.OpenSessionRequest, step: stage_pb2.ForwardRequest):
        # Its receive window stays at HTTP/2's 64 KiB (no BDP probing to widen it): the answers it never reads soon
        # fill it, and the stage's writes wait.
        self.channel = grpc.aio.insecure_channel(proc.address, options=[("grpc.http2.bdp_probe", 0)])
        self.call = stage_pb2_grpc.StageStub(self.channel).Sessions()
        self.open, self.step = open_request, step
        self.written = 0
        self.task = asyncio.get_running_loop().create_task(self._push())

    async def _push(self) -> None:
        await self.call.write(stage_pb2.SessionBatch(opens=[self.open]))
        sid = self.open.session_id
        for _ in range(PUSHED_STEPS):
            await self.call.write(stage_pb2.SessionBatch(steps=[self.step],
                                                         reroute=[stage_pb2.Reroute(session_id=sid, position=0)]))
            self.written += 1

    async def close(self) -> None:
        self.task.cancel()
        self.call.cancel()
        await self.channel.close()


async def held_back(proc, hog: Hog, before: int, settled) -> int:
    """Samples proc's RSS until the stage holds the hog back (settled(its Info) for a second, the hog's writes
    stopped), or its growth passes BOUND; returns the largest growth seen. Bounded: 600 samples."""
    grown, still, written = 0, 0, -1
    for _ in range(600):
        await asyncio.sleep(0.1)
        grown = max(grown, rss(proc) - before)
        if grown > BOUND:
            break
        still = still + 1 if settled(await info(proc)) and written == hog.written else 0
        written = hog.written
        if still >= 10:  # the stage reads no more, and its memory stays where it is
            break
    return grown


async def test_a_client_that_never_reads_leaves_the_stage_memory_bounded(stages, hf_models):
    last = stages["last"]
    before = rss(last)
    step = stage_pb2.ForwardRequest(session_id="hog", start=0, return_logits=True,
                                    hidden=tensor_codec.encode(torch.zeros(STEP_POSITIONS, HIDDEN)))
    hog = Hog(last, stage_pb2.OpenSessionRequest(session_id="hog", max_length=512), step)
    try:
        grown = await held_back(last, hog, before, lambda i: i.streams_waiting >= 1)
        assert grown < BOUND, f"the stage's RSS grew {grown >> 20} MiB for a client that never reads"
        assert hog.written < PUSHED_STEPS, "the stage took every step: nothing held the client back"
        assert (await info(last)).streams_waiting == 1
        await served_exactly(hf_models, stages["first"], last, seed=1)
    finally:
        await hog.close()
    assert rss(last) - before < BOUND


async def test_a_stopped_next_stage_leaves_the_previous_stage_memory_bounded(stages, hf_models):
    first, slow = stages["first"], stages["slow"]
    before = rss(first)
    slow.popen.send_signal(signal.SIGSTOP)
    ids = tensor_codec.encode(torch.tensor(prompt(STEP_POSITIONS, seed=3)))
    opened = stage_pb2.OpenSessionRequest(session_id="hog", max_length=512, next_address=slow.address,
                                          next_key="k" * 32)
    hog = Hog(first, opened, stage_pb2.ForwardRequest(session_id="hog", start=0, token_ids=ids, skip_sample=True))
    try:
        grown = await held_back(first, hog, before, lambda i: i.streams_waiting >= 1 and i.relay_queued_bytes > 0)
        assert grown < BOUND, f"the stage's RSS grew {grown >> 20} MiB for a next stage that stopped"
        held = await info(first)
        assert held.streams_waiting == 1 and 0 < held.relay_queued_bytes < 2 * BOUND
        await served_exactly(hf_models, first, stages["last"], seed=2)
    finally:
        await hog.close()
        slow.popen.send_signal(signal.SIGCONT)
    assert rss(first) - before < BOUND


async def test_sessions_that_close_leave_the_links(stages, hf_models):
    """A link's sessions are those open: after they close, Stage/Info says it carries none."""
    first = stages["first"]
    wants = [hf_greedy(hf_models["llama"], prompt(9, seed=10 + i), 6) for i in range(3)]
    await asyncio.gather(*(served_exactly(hf_models, first, stages["last"], 10 + i, want)
                           for i, want in enumerate(wants)))
    for _ in range(200):
        got = await info(first)
        if got.link_sessions == 0 and got.open_sessions == 0:
            break
        await asyncio.sleep(0.05)
    assert (got.link_sessions, got.open_sessions) == (0, 0)


async def test_a_long_prompt_goes_only_a_few_chunks_ahead_of_a_stopped_stage(stages, hf_models):
    """The router sends a prompt's chunks a bounded number ahead of the last stage's acknowledgements: with the
    last stage stopped, the first runs only that many (its KV cache says how many positions), not the prompt."""
    first, slow = stages["first"], stages["slow"]
    ids = prompt(256, seed=4)
    want = hf_greedy(hf_models["llama"], ids, 1)
    chain = Chain([StageEndpoint(first.address), StageEndpoint(slow.address)])
    try:
        async with ChainSession(chain, 512, "long-prompt", progress=Progress(floor_s=600)) as session:
            slow.popen.send_signal(signal.SIGSTOP)
            step = asyncio.ensure_future(session.step(ids, sampling=Sampling(), chunk_size=16))
            try:
                ran, last, still = 0, -1, 0
                for _ in range(300):  # until the first stage has run what it may (a second unchanged)
                    await asyncio.sleep(0.1)
                    got = await info(first)
                    ran = got.kv_blocks_used * got.kv_block_size
                    still = still + 1 if ran == last and ran > 0 else 0
                    last = ran
                    if still >= 10:
                        break
                ahead = AHEAD_PER_STAGE * 2 * 16
                assert 0 < ran <= ahead + got.kv_block_size, f"the first stage ran {ran} of 256 positions"
            finally:
                slow.popen.send_signal(signal.SIGCONT)
            assert (await step).token_id == want[0]
    finally:
        for stage in chain.stages:
            await stage.close()


async def test_a_slice_swap_without_room_for_both_releases_the_old_slice_first(tiny_model, caplog):
    """--memory-gb that holds one slice and its pool, not two: the old slice goes before the new one loads
    (and the log says so); with room for both, the new one loads beside the old, which serves meanwhile."""
    server = StageServer(StageConfig(model=str(tiny_model), layer_start=0, layer_end=4, port=0, kv_cache_gb=0.05,
                                     memory_gb=0.06))
    await server.start(server.load(0, 4))
    try:
        with caplog.at_level(logging.WARNING, logger=server_log.name):
            await server.swap(4, 8)
            assert server.layers == (4, 8)
            assert "releasing layers 0:4 before loading 4:8" in caplog.text
            caplog.clear()
            server.config.memory_gb = 64.0
            await server.swap(0, 4)
            assert server.layers == (0, 4) and "releasing" not in caplog.text
    finally:
        await server.stop(0)
