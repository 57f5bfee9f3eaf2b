"""A tensor-parallel stage goes down as one: real processes, two chains (one a TP-2 stage, one a plain stage);
a non-zero rank is killed with SIGKILL mid-stream; the streams go on token-exact on the other chain, the
TP stage's rank 0 exits and no rank process is left."""

from __future__ import annotations

import asyncio
import signal
import time

import psutil

from stagemesh import grpc_server
from stagemesh.launcher import LocalMesh, stage_env
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import collect, hf_greedy
from tests.test_exactness import prompt

STREAMS = 4
NEW_TOKENS = 160


def _gone_within(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


async def test_killed_rank_takes_its_stage_down_and_streams_fail_over(tiny_model, hf_models, tmp_path):
    prompts = [prompt(6 + 5 * i, seed=700 + i) for i in range(STREAMS)]
    expected = [hf_greedy(hf_models["llama"], p, NEW_TOKENS) for p in prompts]
    mesh = LocalMesh(str(tiny_model), tmp_path)
    try:
        common = ["stage", "--model", str(tiny_model), "--layers", "0:8", "--port", "0", "--threads", "1",
                  "--kv-cache-gb", "0.05", "--drain-timeout-s", "1"]
        tp_stage, plain = mesh.spawn_together([("stage-tp", [*common, "--tp", "2"]), ("stage-plain", common)],
                                              stage_env(1))
        ranks = [c.pid for c in psutil.Process(tp_stage.pid).children()]
        assert len(ranks) == 1
        router = mesh.spawn("router", ["router", "--model", str(tiny_model), "--port", "0", "--health-interval-s",
                                       "0.2", "--step-timeout-s", "5", "--chain", tp_stage.address,
                                       "--chain", plain.address], stage_env(1))
        async with grpc_server.insecure_channel(router.address) as channel, \
                grpc_server.insecure_channel(tp_stage.address) as tp_channel:
            stub, tp_info = router_pb2_grpc.RouterStub(channel), stage_pb2_grpc.StageStub(tp_channel).Info
            assert (await tp_info(stage_pb2.InfoRequest(), timeout=10)).tp_size == 2
            streams = [asyncio.ensure_future(collect(stub.Generate(
                router_pb2.GenerateRequest(token_ids=p, max_new_tokens=NEW_TOKENS), timeout=120))) for p in prompts]
            for _ in range(400):  # bounded: until the TP stage holds a session mid-stream (or the streams end)
                if (await tp_info(stage_pb2.InfoRequest(), timeout=10)).open_sessions or all(s.done() for s in streams):
                    break
                await asyncio.sleep(0.02)
            assert not all(s.done() for s in streams), "the streams ended before a rank could be killed"
            psutil.Process(ranks[0]).send_signal(signal.SIGKILL)
            results = await asyncio.gather(*streams)
        assert [r[0] for r in results] == expected
        assert tp_stage.popen.wait(timeout=30) != 0, "rank 0 must go down with its rank"
        assert _gone_within([tp_stage.pid, *ranks], 30), "a rank process outlived its stage"
        assert plain.running()
    finally:
        mesh.shutdown(wait_s=5)
