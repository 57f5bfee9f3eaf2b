"""The router's own per-token cost: a real router process in front of a stage that does no work.

    python scripts/dev/bench_router.py [--streams 1,100,1000] [--tokens 32] [--step-ms 0,1000] [--repeats 3]
                                   [--stages 1]

The "instant stage" below is a measuring device, not a model: it implements stagemesh.v1.Stage and
answers every step with token 5 (a non-last stage: sends hidden states of the tiny model's size, 1 KiB,
straight to the next instant stage), either at once
(--step-ms 0: the mesh runs flat out and the router is
the bottleneck) or after a step time drawn uniformly from 0.5..1.5 x --step-ms (a stage that computes,
without spending CPU on it), so that 1,000 streams offer a load the machine can carry. Per setting,
medians over --repeats runs:

- router CPU ms/token: the router process's CPU time over the tokens streamed (the run time of its threads
  from /proc/PID/task/*/schedstat, in nanoseconds: psutil's clock-tick times read 0 for a short run);
- turnaround as the stage sees it (one-stage chains): from the stage sending a session's token to receiving
  that session's next step, i.e. two loopback hops plus everything the router does per token (exact samples);
- turnaround as the router sees it: its stagemesh_router_token_turnaround_seconds histogram, from
  reading the last stage's token to writing the next step (p99 as the bucket bound it falls in);
- the inter-token gap the callers see (with --step-ms > 0 it includes the stage's step time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stagemesh import grpc_server  # noqa: E402
from stagemesh.checkpoint import model_fingerprint, serving_fingerprint  # noqa: E402
from stagemesh.launcher import READY, ensure_tiny_model, even_split, stage_env, wait_for_chains  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2  # noqa: E402
from tests.harness.fault_mesh import free_port  # noqa: E402

TURNAROUND_METRIC = "stagemesh_router_token_turnaround_seconds_bucket"


HIDDEN = tensor_pb2.Tensor(dtype="float32", shape=[1, 256], data=bytes(1024))
"""A decode step's hidden states on the tiny model: what a non-last instant stage sends on."""


class InstantStage(stage_pb2_grpc.StageServicer):
    def __init__(self, layers: tuple[int, int], num_layers: int, step_ms: float, fingerprint: str):
        self.layers = layers
        self.num_layers = num_layers
        self.is_last = layers[1] == num_layers
        self.fingerprint = fingerprint  # the router's model's: it refuses a chain of another
        self.step_s = step_ms / 1000
        self.turnarounds: list[float] = []  # token sent -> the same session's next step received
        self.routes: dict[str, stage_pb2.OpenSessionRequest] = {}  # open sessions: where to send
        self.feeds: dict[str, asyncio.Queue] = {}  # last stage: the router's stream that opened a session
        self.sent_at: dict[str, float] = {}  # one-stage chains: when a session's last token was sent
        self.links: dict[str, tuple[grpc.aio.StreamStreamCall, asyncio.Lock]] = {}

    async def OpenSession(self, request, context):
        self.routes[request.session_id] = request
        return stage_pb2.OpenSessionResponse(session_id=request.session_id)

    async def CloseSession(self, request, context):
        self.routes.pop(request.session_id, None)
        self.feeds.pop(request.session_id, None)
        return stage_pb2.CloseSessionResponse()

    async def _send_on(self, route: stage_pb2.OpenSessionRequest, request: stage_pb2.ForwardRequest) -> None:
        link = self.links.get(route.next_address)
        if link is None:
            link = self.links[route.next_address] = (stage_pb2_grpc.StageStub(
                grpc_server.insecure_channel(route.next_address)).Relay(), asyncio.Lock())
        call, lock = link
        async with lock:  # one write at a time on a stream
            await call.write(stage_pb2.RelayBatch(steps=[stage_pb2.ForwardRequest(
                session_id=request.session_id, start=request.start, hidden=HIDDEN, hop_key=route.next_key,
                skip_sample=request.skip_sample)]))

    async def Sessions(self, request_iterator, context):
        """The router's one stream here for all its sessions, batched both ways."""
        events: asyncio.Queue = asyncio.Queue()  # a session id (opened) or a ForwardResponse (last stage's token)
        running: set[asyncio.Task] = set()

        async def read() -> None:
            async for batch in request_iterator:
                for request in batch.opens:
                    await self.OpenSession(request, context)
                    self.feeds[request.session_id] = events
                    events.put_nowait(request.session_id)
                for request in batch.steps:  # first stage: steps go on over Relay (or answer, on one stage)
                    if (sent_at := self.sent_at.pop(request.session_id, None)) is not None:
                        self.turnarounds.append(time.perf_counter() - sent_at)
                    task = asyncio.get_running_loop().create_task(self._relayed(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                for sid in batch.close:
                    self.routes.pop(sid, None)
                    self.feeds.pop(sid, None)
                    self.sent_at.pop(sid, None)

        loop, written_at = asyncio.get_running_loop(), 0.0
        reader = loop.create_task(read())
        try:
            while True:
                message = stage_pb2.SessionEvents()
                item = await events.get()
                if wait := grpc_server.busy_wait_s(len(self.feeds), loop.time() - written_at):
                    await asyncio.sleep(wait)  # as a real stage does
                written_at = loop.time()
                while True:
                    if isinstance(item, str):
                        message.opened.append(item)
                    else:
                        message.results.append(item)
                    if events.empty():
                        break
                    item = events.get_nowait()
                yield message
                now = time.perf_counter()  # the generator resumes once the message is on its way
                for result in message.results:
                    self.sent_at[result.session_id] = now
        finally:
            reader.cancel()

    async def Relay(self, request_iterator, context):
        running: set[asyncio.Task] = set()
        async for batch in request_iterator:
            for request in batch.steps:
                if self.step_s:  # the sessions on one link compute side by side
                    task = asyncio.get_running_loop().create_task(self._relayed(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                else:
                    await self._relayed(request)
        if False:  # an async generator that answers nothing
            yield

    async def _relayed(self, request: stage_pb2.ForwardRequest) -> None:
        route = self.routes.get(request.session_id)
        if route is None:
            return
        if self.step_s:
            await asyncio.sleep(self.step_s * random.uniform(0.5, 1.5))
        if route.next_address:
            await self._send_on(route, request)
        elif not request.skip_sample and request.session_id in self.feeds:
            self.feeds[request.session_id].put_nowait(stage_pb2.ForwardResponse(session_id=request.session_id,
                                                                                token_id=5))

    async def Info(self, request, context):
        return stage_pb2.StageInfo(layer_start=self.layers[0], layer_end=self.layers[1], num_layers=self.num_layers,
                                   is_first=self.layers[0] == 0, is_last=self.is_last, fingerprint=self.fingerprint)

    def dump(self, path: Path) -> None:
        """SIGUSR1: hand the samples so far to the benchmark (written whole, then renamed) and start afresh."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.turnarounds))
        tmp.rename(path)
        self.turnarounds = []


async def serve_instant_stage(layers: tuple[int, int], num_layers: int, step_ms: float, dump_path: Path,
                              fingerprint: str) -> None:
    stage = InstantStage(layers, num_layers, step_ms, fingerprint)
    server = grpc_server.new_server()
    stage_pb2_grpc.add_StageServicer_to_server(stage, server)
    health = grpc_server.add_health_and_reflection(server, ["stagemesh.v1.Stage"])
    port = grpc_server.bind(server, "127.0.0.1", 0)
    await server.start()
    await grpc_server.set_serving(health, ["stagemesh.v1.Stage"], True)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, stage.dump, dump_path)
    print(f"stage ready on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=stage_env(None))
    for line in proc.stdout:
        if m := READY.search(line):
            return proc, m.group(2)
    raise RuntimeError(f"{args} did not start")


def router_histogram(metrics_port: int) -> dict[float, float]:
    """Cumulative bucket counts of the router's turnaround histogram, by upper bound."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    buckets = {}
    for line in text.splitlines():
        if line.startswith(TURNAROUND_METRIC):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
    return buckets


def bucket_bound(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The smallest bucket bound under which at least q of this run's observations fall."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts.get(math.inf, 0.0)
    return next((le for le, n in counts.items() if total and n >= q * total), math.nan)


def percentile(samples: list[float], q: float) -> float:
    """The smallest sample with at least q of them at or below it (nan when there are none)."""
    if not samples:
        return math.nan
    samples = sorted(samples)
    return samples[max(0, math.ceil(q * len(samples)) - 1)]


async def one_stream(stub, tokens: int, gaps: list[float]) -> int:
    request = router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=tokens)
    last, n = None, 0
    async for response in stub.Generate(request, timeout=1800):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        n += len(response.token_ids)
    return n


def cpu_seconds(pid: int) -> float:
    """The CPU time of the process's live threads, at the scheduler's nanosecond resolution (psutil's
    cpu_times counts 10 ms clock ticks, which a few hundred router tokens do not fill); falls back to
    those ticks where /proc has no schedstat."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended between the listing and the read
    except FileNotFoundError:
        return sum(psutil.Process(pid).cpu_times()[:2])
    return total / 1e9


async def run_level(address: str, router_pid: int, streams: int, tokens: int) -> tuple[int, float, float, list]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        gaps: list[float] = []
        cpu0 = cpu_seconds(router_pid)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(stub, tokens, gaps) for _ in range(streams)))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(router_pid) - cpu0
    return sum(counts), wall, cpu, gaps


def collect_stage_samples(stage: subprocess.Popen, path: Path) -> list[float]:
    path.unlink(missing_ok=True)
    stage.send_signal(signal.SIGUSR1)
    for _ in range(200):
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise RuntimeError("the instant stage did not hand over its samples")


def measure(model: str, layers: int, step_ms: float, streams_list: list[int], tokens: int,
            repeats: int, n_stages: int = 1) -> list[dict]:
    dump_path = Path(f"/tmp/bench-router-{os.getpid()}.json")
    fingerprint = serving_fingerprint(model_fingerprint(model), "float32", "none")
    spawned = [spawn([sys.executable, __file__, "--serve-instant-stage", f"{a}:{b}:{layers}",
                      "--step-ms", str(step_ms), "--dump", str(dump_path), "--fingerprint", fingerprint])
               for a, b in even_split(layers, n_stages)]
    stages = [proc for proc, _ in spawned]
    stage = stages[0]  # the stage whose turnarounds are sampled (on a one-stage chain: it sends and receives)
    metrics_port = free_port()
    router, router_address = spawn([sys.executable, "-m", "stagemesh.cli", "--log-level", "warning", "router",
                                    "--model", model, "--chain", ",".join(address for _, address in spawned),
                                    "--port", "0", "--metrics-port", str(metrics_port), "--slots-per-chain", "100000"])

    def one_run(streams: int) -> dict:
        collect_stage_samples(stage, dump_path)  # drop anything from before this run
        before = router_histogram(metrics_port)
        total, wall, cpu, gaps = asyncio.run(run_level(router_address, router.pid, streams, tokens))
        after = router_histogram(metrics_port)
        seen = collect_stage_samples(stage, dump_path)
        return {
            "tokens_per_s": total / wall,
            "router_cpu_ms_per_token": 1000 * cpu / total,
            "stage_seen_median_ms": 1000 * percentile(seen, 0.5),
            "stage_seen_p99_ms": 1000 * percentile(seen, 0.99),
            "router_seen_p50_le_ms": 1000 * bucket_bound(before, after, 0.50),
            "router_seen_p99_le_ms": 1000 * bucket_bound(before, after, 0.99),
            "gap_median_ms": 1000 * percentile(gaps, 0.5),
            "gap_p99_ms": 1000 * percentile(gaps, 0.99),
        }

    rows = []
    try:
        wait_for_chains(router_address, 1, timeout=60)  # its health checks passed
        for streams in streams_list:
            runs = [one_run(streams) for _ in range(repeats)]
            row = {"stages": n_stages, "step_ms": step_ms, "streams": streams, "runs": runs}
            row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            rows.append(row)
            print_row(row)
    finally:
        for proc in (router, *stages):
            proc.terminate()
            proc.wait(timeout=10)
        dump_path.unlink(missing_ok=True)
    return rows


HEADER = (f"{'stages':>6} "
          f"{'step ms':>7} {'streams':>7} {'tokens/s':>8} {'router CPU':>10} {'turnaround seen by stage':>24} "
          f"{'by router':>15} {'caller gap':>15}\n"
          f"{'':>6} "
          f"{'':>7} {'':>7} {'':>8} {'ms/token':>10} {'median ms':>11} {'p99 ms':>12} {'p50 ≤':>7} {'p99 ≤':>7} "
          f"{'median':>7} {'p99':>7}")


def print_row(r: dict) -> None:
    print(f"{r['stages']:>6} "
          f"{r['step_ms']:>7.0f} {r['streams']:>7} {r['tokens_per_s']:>8.0f} {r['router_cpu_ms_per_token']:>10.3f} "
          f"{r['stage_seen_median_ms']:>11.3f} {r['stage_seen_p99_ms']:>12.3f} {r['router_seen_p50_le_ms']:>7.2f} "
          f"{r['router_seen_p99_le_ms']:>7.2f} {r['gap_median_ms']:>7.1f} {r['gap_p99_ms']:>7.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-instant-stage", default=None, help=argparse.SUPPRESS)  # START:END:LAYERS
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--fingerprint", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="checkpoint for the router's tokenizer (default: tiny)")
    p.add_argument("--streams", default="1,100,1000", help="concurrent streams, e.g. 1,100,1000")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per stream")
    p.add_argument("--step-ms", default="0,1000",
                   help="the instant stage's mean step time per setting (0: answer at once)")
    p.add_argument("--stages", type=int, default=1, help="instant stages per chain")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; the table shows their medians")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args()
    if a.serve_instant_stage is not None:
        start, end, num_layers = (int(x) for x in a.serve_instant_stage.split(":"))
        asyncio.run(serve_instant_stage((start, end), num_layers, float(a.step_ms), a.dump, a.fingerprint))
        return
    model = a.model or str(ensure_tiny_model(Path("models/tiny-llama")))
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    streams = [int(s) for s in a.streams.split(",")]
    print(HEADER)
    rows = []
    for step_ms in (float(s) for s in a.step_ms.split(",")):
        rows += measure(model, layers, step_ms, streams, a.tokens, a.repeats, a.stages)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "rows": rows},
                                    indent=1))


if __name__ == "__main__":
    main()
