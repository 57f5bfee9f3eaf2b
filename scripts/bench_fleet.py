"""The control plane at fleet size, without the models: simulated stages on a real 3-member etcd cluster, the real
scheduler as its own process, and router-like watchers of the chain table.

    python scripts/bench_fleet.py [--stages 50,100,200,500] [--watchers 20] [--out fleet.json]

Each simulated stage registers as a real stage does (its record and heartbeats on two etcd leases every TTL/4,
its assignment watched and, once assigned, re-registered as loaded and serving), five stages to a simulated host
whose health server answers for them; no weights are loaded. A host's stages hold about a fifth of the model each,
so every chain takes five of them. Per fleet size it reports:
- plan + publish: from the last stage registering to every watcher holding a table with every chain;
- host loss: one host's heartbeats and health server stop at once; time until every watcher holds a table without
  its chain (p50 and max over the watchers): the lease TTL, the scheduler's reconcile, the watch fan-out;
- heartbeats/s the fleet sends and etcd's CPU (all members, % of one core) in the steady state;
- the scheduler's reconcile time (its own histogram, from its metrics port).
Everything runs on this machine: past some size the simulated fleet's own process, not etcd or the scheduler, is what
saturates first; the report says which process was busiest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.harness: the etcd cluster

import grpc  # noqa: E402
import psutil  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stagemesh.checkpoint import ModelFootprint, model_fingerprint
from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.chain_table import decode_chains
from stagemesh.discovery.registry import ServiceRecord, assignment_key, chains_key
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import stage_pb2
from tests.harness.etcd_cluster import EtcdCluster
from tests.harness.fault_mesh import free_port

STAGES_PER_HOST = 5
TTL_S = 2.0  # a stage's default lease (RegistrationConfig.ttl_s)
STAGE_SERVICE = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name


# ---- the simulated fleet (its own process: --role fleet) ----

class SimulatedHost:
    """One machine's stages: a health server that answers for all of them, and each stage's registration."""

    def __init__(self, index: int, url: str, model: str, budget: int, fingerprint: str):
        self.index, self.url, self.model, self.budget, self.fingerprint = index, url, model, budget, fingerprint
        self.port = free_port()
        self.registry = open_registry(url)
        self.tasks: list[asyncio.Task] = []
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        await servicer.set(STAGE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        loop = asyncio.get_running_loop()
        for i in range(STAGES_PER_HOST):
            sid = f"sim-{self.index:03d}-{i}"
            self.tasks.append(loop.create_task(self._stage(sid)))

    def record(self, sid: str, layers: str) -> ServiceRecord:
        return ServiceRecord(sid, f"127.0.0.1:{self.port}", self.model, {
            "layers": layers, "ready": "1" if layers else "0", "fixed": "0", "budget_bytes": str(self.budget),
            "speed": "1", "dtype": "float32", "quantize": "none", "device": "cpu", "fingerprint": self.fingerprint,
            "host": f"host-{self.index:03d}", "devices": "1", "tp": "1"})

    async def _stage(self, sid: str) -> None:
        layers = ""
        await self.registry.register(self.record(sid, layers), TTL_S)
        beat = asyncio.get_running_loop().create_task(self._heartbeat(sid))
        try:
            index = 0
            while True:
                index, entry = await self.registry.watch_key(assignment_key(self.model, sid), index, timeout_s=30)
                want = entry.value.decode() if entry else ""
                if want and want != layers:
                    layers = want  # "loaded" at once: no weights here
                    await self.registry.register(self.record(sid, layers), TTL_S)
        finally:
            beat.cancel()

    async def _heartbeat(self, sid: str) -> None:
        while True:
            await asyncio.sleep(TTL_S / 4)
            if not await self.registry.heartbeat(sid):
                await self.registry.register(self.record(sid, ""), TTL_S)
            HEARTBEATS[0] += 1

    async def lose(self) -> None:
        """Like a host losing power: no goodbye, no more heartbeats, nothing answers."""
        for t in self.tasks:
            t.cancel()
        await self.server.stop(0)


HEARTBEATS = [0]


async def run_fleet(args) -> None:
    first = args.first_host
    hosts = [SimulatedHost(i, args.url, args.model_name, args.budget, args.fingerprint)
             for i in range(first, first + args.stages // STAGES_PER_HOST)]
    for h in hosts:
        await h.start()
    print("registered", flush=True)
    # Commands on stdin: "lose N" (a host), "rate" (heartbeats/s over the next second), "quit".
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "lose":
            host = hosts[int(line[1]) - first]
            await host.lose()
            print(f"lost 127.0.0.1:{host.port}", flush=True)
        elif line[0] == "rate":
            before, t0 = HEARTBEATS[0], time.monotonic()
            await asyncio.sleep(float(line[1]))
            print(f"rate {(HEARTBEATS[0] - before) / (time.monotonic() - t0):.1f}", flush=True)
        else:
            break


# ---- router-like watchers (--role watchers) ----

async def run_watchers(args) -> None:
    """Each watcher follows the chain table as a router does and prints (watcher, wall time, chains) on each
    version it sees."""
    async def watch(w: int) -> None:
        registry = open_registry(args.url)
        index = 0
        while True:
            index, entry = await registry.watch_key(chains_key(args.model_name), index, timeout_s=30)
            if entry is None:
                continue
            try:
                chains = decode_chains(entry.value)
            except ValueError:
                continue
            print(json.dumps({"w": w, "t": time.time(), "chains": len(chains),
                              "hosts": sorted({s.address for c in chains for s in c.stages})}), flush=True)

    await asyncio.gather(*(watch(w) for w in range(args.watchers)))


# ---- the orchestrator ----

class Watchers:
    """The watchers' process and what each last saw."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.events: list[dict] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def poll(self) -> None:
        while not self._lines.empty():
            self.events.append(json.loads(self._lines.get()))

    def wait(self, predicate, n: int, timeout_s: float) -> list[float] | None:
        """Each watcher's first time at which predicate(event) held, once all n did; None on timeout."""
        deadline = time.monotonic() + timeout_s
        first: dict[int, float] = {}
        while time.monotonic() < deadline:
            self.poll()
            for e in self.events:
                if e["w"] not in first and predicate(e):
                    first[e["w"]] = e["t"]
            if len(first) == n:
                return [first[w] for w in range(n)]
            time.sleep(0.02)
        return None


def cpu_percent(procs: list[psutil.Process], seconds: float) -> float:
    for p in procs:
        p.cpu_percent(None)
    time.sleep(seconds)
    return sum(p.cpu_percent(None) for p in procs)


def reconcile_ms(metrics_port: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = count = None
    for line in text.splitlines():
        if line.startswith("stagemesh_scheduler_reconcile_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("stagemesh_scheduler_reconcile_seconds_count"):
            count = float(line.split()[-1])
    return 1000 * total / count if total is not None and count else None


def measure(stages: int, args, workdir: Path, model: Path, budget: int, fingerprint: str) -> dict:
    cluster = EtcdCluster(workdir / f"etcd-{stages}", members=3).start()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    name = model.name
    metrics_port = free_port()
    me = [sys.executable, __file__, "--url", cluster.url, "--model-name", name]
    procs: list[subprocess.Popen] = []
    try:
        scheduler = subprocess.Popen([sys.executable, "-m", "stagemesh.cli", "scheduler", "--model", str(model),
                                      "--registry", cluster.url, "--metrics-port", str(metrics_port),
                                      "--log-level", "warning"], env=env)
        procs.append(scheduler)
        watchers = Watchers([*me, "--role", "watchers", "--watchers", str(args.watchers)])
        procs.append(watchers.proc)
        fleets = []
        per = args.stages_per_process
        for first in range(0, stages, per):  # the fleet in several processes: one would saturate first
            fleets.append(subprocess.Popen(
                [*me, "--role", "fleet", "--stages", str(min(per, stages - first)), "--budget", str(budget),
                 "--fingerprint", fingerprint, "--first-host", str(first // STAGES_PER_HOST)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env))
        procs.extend(fleets)
        for fleet in fleets:
            assert fleet.stdout.readline().strip() == "registered"
        registered = time.time()
        full = stages // STAGES_PER_HOST
        seen = watchers.wait(lambda e: e["chains"] == full, args.watchers, args.timeout_s)
        row = {"stages": stages, "chains": full,
               "plan_publish_s": None if seen is None else max(seen) - registered}
        etcd = [psutil.Process(p.pid) for p in cluster.procs if p is not None]
        for fleet in fleets:
            fleet.stdin.write("rate 3\n")
            fleet.stdin.flush()
        row["etcd_cpu_pct"] = cpu_percent(etcd, 3.0)
        row["heartbeats_per_s"] = sum(float(fleet.stdout.readline().split()[1]) for fleet in fleets)
        row["fleet_cpu_pct"] = cpu_percent([psutil.Process(f.pid) for f in fleets], 2.0)
        row["scheduler_cpu_pct"] = cpu_percent([psutil.Process(scheduler.pid)], 2.0)
        if seen is not None:
            fleets[0].stdin.write("lose 0\n")
            fleets[0].stdin.flush()
            lost = fleets[0].stdout.readline().split()[1]
            lost_at = time.time()
            watchers.events.clear()
            gone = watchers.wait(lambda e: lost not in e["hosts"], args.watchers, args.timeout_s)
            if gone is not None:
                delays = sorted(t - lost_at for t in gone)
                row["loss_to_table_p50_s"] = statistics.median(delays)
                row["loss_to_table_max_s"] = delays[-1]
        row["reconcile_ms_mean"] = reconcile_ms(metrics_port)
        for fleet in fleets:
            fleet.stdin.write("quit\n")
            fleet.stdin.flush()
        return row
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="50,100,200,500", help="fleet sizes, comma-separated (multiples of 5)")
    parser.add_argument("--watchers", type=int, default=20, help="router-like watchers of the chain table")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on each wait")
    parser.add_argument("--stages-per-process", type=int, default=100,
                        help="simulated stages per fleet process (a multiple of 5)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("--first-host", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("orchestrate", "fleet", "watchers"), default="orchestrate",
                        help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fingerprint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "fleet":
        args.stages = int(args.stages)
        asyncio.run(run_fleet(args))
        return
    if args.role == "watchers":
        asyncio.run(run_watchers(args))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = make_tiny_model(workdir / "fleet-model", "llama", layers=40, seed=1)
        footprint = ModelFootprint.from_model_dir(model)
        budget = int(footprint.total_bytes * 0.25 / 0.8)  # a fifth of the model, with room to spare
        fingerprint = model_fingerprint(str(model))
        for stages in [int(s) for s in args.stages.split(",")]:
            row = measure(stages, args, workdir, model, budget, fingerprint)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


def print_table(rows: list[dict]) -> None:
    cols = ["stages", "chains", "plan_publish_s", "loss_to_table_p50_s", "loss_to_table_max_s", "heartbeats_per_s",
            "etcd_cpu_pct", "fleet_cpu_pct", "scheduler_cpu_pct", "reconcile_ms_mean"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r.get(c):.2f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols))


if __name__ == "__main__":
    main()
