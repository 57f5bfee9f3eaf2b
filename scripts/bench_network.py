"""Per-token decode time over slow links, against the network floor t0 + (N+1)·D.

    python scripts/bench_network.py [--stages 2,4] [--delays-ms 0,1,5,20] [--tokens 24] [--repeats 5]

A chain of N stage processes (the tiny model, one thread each), each behind a link proxy
(tests/harness/link_proxy.py) that holds every chunk D ms each way. The router dials the proxies, and so do
the stages (a stage is told its next stage's address as the router knows it): every link of the data
path is delayed, stage to stage and last stage to router included. Per setting: the median inter-token gap of
one stream (decode only), the median over --repeats streams, against the model

    t0 + (N+1)·D (router -> stage 1 -> ... -> stage N -> router)

with t0 the time at D = 0 measured in the same run. (Relay mode, where the router carried every hop,
t0 + 2N·D, is gone: stages forward to each other, the router's only data path.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stagemesh import grpc_server  # noqa: E402
from stagemesh.launcher import ensure_tiny_model, even_split, stage_env, wait_for_chains  # noqa: E402
from stagemesh.processes import LocalMesh  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tests.harness.link_proxy import LinkProxy  # noqa: E402

MODES = ("forwarding",)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


async def gaps_of_one_stream(address: str, tokens: int) -> list[float]:
    """The decode inter-token gaps (seconds) of one stream of `tokens` new tokens."""
    async with grpc_server.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=tokens)
        gaps, last = [], None
        async for _ in stub.Generate(request, timeout=600):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    if len(gaps) < tokens - 1:
        raise RuntimeError(f"the stream ended after {len(gaps) + 1} tokens (an eos?): use another prompt")
    return gaps


def measure_chain(model: str, layers: int, stages: int, delays_ms: list[float], tokens: int, repeats: int,
                  log_dir: Path) -> list[dict]:
    mesh = LocalMesh(model, log_dir)
    proxies: list[LinkProxy] = []
    try:
        common = ["stage", "--model", model, "--port", "0", "--threads", "1", "--kv-cache-gb", "0.05"]
        started = mesh.spawn_together([(f"n{stages}-stage{i}", [*common, "--layers", f"{a}:{b}"])
                                       for i, (a, b) in enumerate(even_split(layers, stages))], stage_env(1))
        ports = [int(proc.address.rpartition(":")[2]) for proc in started]
        proxies = [LinkProxy(f"127.0.0.1:{port}").start() for port in ports]
        spec = ",".join(p.address for p in proxies)
        routers = {}
        for mode in MODES:
            proc = mesh.spawn(f"n{stages}-router-{mode}", ["--log-level", "warning", "router", "--model", model,
                                                           "--chain", spec, "--port", "0"], stage_env(None))
            routers[mode] = proc.address
            wait_for_chains(proc.address, 1)
        rows = []
        for delay in delays_ms:
            for p in proxies:
                p.set(delay_s=delay / 1000)
            for mode in MODES:  # warm-up: channels up, first-use costs paid
                asyncio.run(gaps_of_one_stream(routers[mode], 4))
            per_mode: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(repeats):
                for mode in MODES:
                    gaps = asyncio.run(gaps_of_one_stream(routers[mode], tokens))
                    per_mode[mode].append(statistics.median(gaps) * 1000)
            row = {"stages": stages, "delay_ms": delay,
                   **{f"{m}_ms": statistics.median(per_mode[m]) for m in MODES}, "runs": per_mode}
            rows.append(row)
            print(f"  N={stages} D={delay:g} ms: {row['forwarding_ms']:.1f} ms/token", flush=True)
        return rows
    finally:
        mesh.stop()  # first: the proxies then have no connection left to cut
        for p in proxies:
            p.stop()


def with_models(rows: list[dict]) -> list[dict]:
    """Adds the model (t0 + (N+1)·D, t0 the D = 0 time in this run) and the ratio."""
    t0 = {r["stages"]: r["forwarding_ms"] for r in rows if r["delay_ms"] == 0}
    for r in rows:
        n, d = r["stages"], r["delay_ms"]
        r["forwarding_model_ms"] = t0[n] + (n + 1) * d
        r["forwarding_vs_model"] = r["forwarding_ms"] / r["forwarding_model_ms"]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'N':>2} {'D ms':>5} | {'ms/token':>8} {'t0+(N+1)D':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['stages']:>2} {r['delay_ms']:>5g} | {r['forwarding_ms']:>8.1f} {r['forwarding_model_ms']:>9.1f} "
              f"{r['forwarding_vs_model']:>6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny model, made if missing)")
    p.add_argument("--stages", default="2,4", help="chain lengths, e.g. 2,4")
    p.add_argument("--delays-ms", default="0,1,5,20", help="one-way delay per link, ms (0 first: it is t0)")
    p.add_argument("--tokens", type=int, default=24, help="new tokens per stream")
    p.add_argument("--repeats", type=int, default=5, help="streams per setting; medians are shown")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args()
    model = a.model or str(ensure_tiny_model(Path("models/tiny-llama")))
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    delays = [float(d) for d in a.delays_ms.split(",")]
    if delays[0] != 0:
        delays.insert(0, 0.0)
    # The proxies are threads of this process: let a proxy whose chunk is due take the GIL at once
    # (the default 5 ms switch interval would add up to that much to a hop).
    sys.setswitchinterval(0.0002)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-network-") as log_dir:
        for n in (int(s) for s in a.stages.split(",")):
            rows += measure_chain(model, layers, n, delays, a.tokens, a.repeats, Path(log_dir))
    print_table(with_models(rows))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "rows": rows},
                                    indent=1))


if __name__ == "__main__":
    main()
