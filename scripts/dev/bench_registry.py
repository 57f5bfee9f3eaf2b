"""What a registry call costs on each backend, side by side in one run: the embedded registry (its gRPC
server in this process), etcd with one member, and etcd with three members on loopback.

    python scripts/dev/bench_registry.py [--calls 200] [--wakes 50] [--quick]

Per backend, medians in milliseconds of:
- kv_get: one read (etcd: a linearizable read, through the leader);
- kv_cas: a check-and-set write of the chains key (etcd: a transaction, committed by a quorum);
- heartbeat: one stage's heartbeat (etcd: a keep-alive of each of its two leases);
- watch wake: from a kv_put starting to a blocked watch_key returning the new value (what a router
  waits for a new chain table, and a stage for its assignment).
Ratios are to the embedded registry. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.registry import ServiceRecord, chains_key
from stagemesh.registry.service import start_registry_server
from tests.harness.etcd_cluster import EtcdCluster

MODEL = "bench/model"


async def _timed(calls: int, fn) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


async def measure(url: str, calls: int, wakes: int) -> dict[str, float]:
    registry, watcher = open_registry(url), open_registry(url)
    try:
        await registry.kv_put(chains_key(MODEL), b"x" * 2048)
        result = {"kv_get": await _timed(calls, lambda: registry.kv_get(chains_key(MODEL)))}

        async def cas():
            _, index = await registry.kv_get(chains_key(MODEL))
            assert await registry.kv_cas(chains_key(MODEL), b"y" * 2048, index)

        result["kv_cas"] = await _timed(calls, cas)
        record = ServiceRecord("bench-stage", "127.0.0.1:1", MODEL, {"layers": "0:4"})
        await registry.register(record, ttl_s=30)
        result["heartbeat"] = await _timed(calls, lambda: registry.heartbeat(record.service_id))
        await registry.deregister(record.service_id)

        samples = []
        for i in range(wakes):
            index, _ = await watcher.watch_key(chains_key(MODEL), 0, 0)
            watch = asyncio.create_task(watcher.watch_key(chains_key(MODEL), index, 10))
            await asyncio.sleep(0.05)  # the watch is waiting
            started = time.perf_counter()
            await registry.kv_put(chains_key(MODEL), str(i).encode())
            _, entry = await watch
            samples.append(time.perf_counter() - started)
            assert entry is not None and entry.value == str(i).encode()
        result["watch_wake"] = statistics.median(samples) * 1000
        return result
    finally:
        await registry.close()
        await watcher.close()


async def main(args) -> dict:
    report = {"meta": {"calls": args.calls, "wakes": args.wakes, "date": time.strftime("%Y-%m-%d")}, "backends": {}}
    server = await start_registry_server("127.0.0.1", 0)
    try:
        report["backends"]["embedded"] = await measure(f"local://{server.address}", args.calls, args.wakes)
    finally:
        await server.stop(0)
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as tmp:
        for members in (1, 3):
            cluster = await asyncio.to_thread(EtcdCluster(Path(tmp) / f"etcd{members}", members).start)
            try:
                report["backends"][f"etcd x{members}"] = await measure(cluster.url, args.calls, args.wakes)
            finally:
                await asyncio.to_thread(cluster.stop)
    return report


def print_table(report: dict) -> None:
    backends = report["backends"]
    base = backends["embedded"]
    print("| median, ms | " + " | ".join(backends) + " |")
    print("| --- |" + " ---: |" * len(backends))
    for what in base:
        cells = [f"{b[what]:.2f}" + ("" if name == "embedded" else f" ({b[what] / base[what]:.1f}x)")
                 for name, b in backends.items()]
        print(f"| {what} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls timed per operation")
    parser.add_argument("--wakes", type=int, default=50, help="watch wakes timed")
    parser.add_argument("--quick", action="store_true", help="20 calls and 5 wakes (a smoke test)")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.wakes = 20, 5
    report = asyncio.run(main(args))
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
