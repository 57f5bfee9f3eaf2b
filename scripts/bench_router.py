"""The router's own per-token cost: a real router process in front of a stage that answers instantly.

    python scripts/bench_router.py [--streams 1,100,1000] [--tokens 64]

The "instant stage" below is a measuring device, not a model: it implements stagemesh.v1.Stage and
returns token 5 for every step at once, so what remains is the router (validation, admission,
its per-token loop, detokenizing, streaming) plus the gRPC hops. It reports, per concurrency:
the router process's CPU time per token (from /proc, so it counts only the router), and the
inter-token gap the callers see (median, p99).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stagemesh import grpc_server  # noqa: E402
from stagemesh.launcher import READY, ensure_tiny_model, stage_env  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc  # noqa: E402


class InstantStage(stage_pb2_grpc.StageServicer):
    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    async def OpenSession(self, request, context):
        return stage_pb2.OpenSessionResponse(session_id=request.session_id)

    async def CloseSession(self, request, context):
        return stage_pb2.CloseSessionResponse()

    async def Forward(self, request_iterator, context):
        async for request in request_iterator:
            yield stage_pb2.ForwardResponse(session_id=request.session_id, token_id=5)

    async def Info(self, request, context):
        return stage_pb2.StageInfo(layer_start=0, layer_end=self.num_layers, num_layers=self.num_layers,
                                   is_first=True, is_last=True)


async def serve_instant_stage(num_layers: int) -> None:
    server = grpc_server.new_server()
    stage_pb2_grpc.add_StageServicer_to_server(InstantStage(num_layers), server)
    health = grpc_server.add_health_and_reflection(server, ["stagemesh.v1.Stage"])
    port = grpc_server.bind(server, "127.0.0.1", 0)
    await server.start()
    await grpc_server.set_serving(health, ["stagemesh.v1.Stage"], True)
    print(f"stage ready on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=stage_env(None))
    for line in proc.stdout:
        if m := READY.search(line):
            return proc, m.group(2)
    raise RuntimeError(f"{args} did not start")


async def one_stream(stub, tokens: int, gaps: list[float]) -> int:
    request = router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=tokens)
    last, n = None, 0
    async for response in stub.Generate(request, timeout=600):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        n += len(response.token_ids)
    return n


async def run_level(address: str, router_pid: int, streams: int, tokens: int) -> dict:
    router = psutil.Process(router_pid)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        gaps: list[float] = []
        cpu0 = sum(router.cpu_times()[:2])
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(stub, tokens, gaps) for _ in range(streams)))
        wall = time.perf_counter() - t0
        cpu = sum(router.cpu_times()[:2]) - cpu0
    total = sum(counts)
    gaps.sort()
    return {
        "streams": streams,
        "tokens": total,
        "router_cpu_ms_per_token": 1000 * cpu / total,
        "gap_median_ms": 1000 * statistics.median(gaps),
        "gap_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
        "tokens_per_s": total / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--serve-instant-stage", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="checkpoint for the router's tokenizer (default: tiny)")
    p.add_argument("--streams", default="1,100,1000")
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    if a.serve_instant_stage is not None:
        asyncio.run(serve_instant_stage(a.serve_instant_stage))
        return
    model = a.model or str(ensure_tiny_model(Path("models/tiny-llama")))
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    stage, stage_address = spawn([sys.executable, __file__, "--serve-instant-stage", str(layers)])
    router, router_address = spawn([sys.executable, "-m", "stagemesh.cli", "--log-level", "warning", "router",
                                    "--model", model, "--chain", stage_address, "--port", "0",
                                    "--slots-per-chain", "100000"])
    try:
        time.sleep(1.5)  # the router's first health check
        print(f"{'streams':>8} {'tokens':>8} {'router CPU ms/token':>20} {'gap median ms':>14} "
              f"{'gap p99 ms':>11} {'tokens/s':>9}")
        for streams in (int(s) for s in a.streams.split(",")):
            r = asyncio.run(run_level(router_address, router.pid, streams, a.tokens))
            print(f"{r['streams']:>8} {r['tokens']:>8} {r['router_cpu_ms_per_token']:>20.3f} "
                  f"{r['gap_median_ms']:>14.2f} {r['gap_p99_ms']:>11.2f} {r['tokens_per_s']:>9.0f}", flush=True)
    finally:
        for proc in (router, stage):
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
