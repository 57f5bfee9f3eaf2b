"""Length-aware routing measured: time to first token per class of prompt, with the rule and without, side by side.

    python scripts/bench_routing.py [--replicas 2] [--requests 40] [--interval-ms 60] [--repeats 3] [--tp K]

A mesh of stage processes found through a scheduler (the embedded registry): --replicas whole-model stages
(one thread each) and one wide chain. The wide chain is a 2-stage pipeline (one thread per stage) standing in
for a tensor-parallel stage, or, with --tp K, one stage started with `--tp K` (a real tensor-parallel group where
the stage implements it, issue 13; elsewhere the flag only announces K ranks, and the figures are a pipeline's
or a replica's). Two routers follow the same chains: one with the rule (--long-prompt-tokens, default 512), one
without (--long-prompt-tokens 0: the least loaded chain). The same seeded open-loop workload (80% short prompts,
20% long ones of at least 2,048 tokens, arrivals every --interval-ms on average) runs through each in turn, in
alternating order over --repeats rounds. Reported per router and class: time to first token, median and p90 over
every request of every round, and the router's own count of picks that went to the preferred kind or fell back.

The tiny model is made with a 4,096-position context (models/tiny-llama-4k), so that 2,048-token prompts fit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from stagemesh import grpc_server  # noqa: E402
from stagemesh.launcher import stage_env, wait_for_chains  # noqa: E402
from stagemesh.processes import LocalMesh  # noqa: E402
from stagemesh.tiny_model import make_tiny_model  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tests.harness.fault_mesh import free_port  # noqa: E402

MODES = ("rule", "no rule")
CLASSES = ("short", "long")


def tiny_model_4k(path: Path) -> Path:
    if not (path / "config.json").exists():
        print(f"making a tiny random model with a 4,096-position context in {path}", flush=True)
        make_tiny_model(path, "llama", max_position=4096)
    return path


def workload(n: int, short_tokens: int, long_tokens: int, interval_s: float, seed: int) -> list[dict]:
    """n requests: (arrival offset, class, prompt ids); 1 in 5 long, arrivals a Poisson process."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        cls = "long" if i % 5 == 2 else "short"
        size = long_tokens if cls == "long" else short_tokens
        out.append({"at": t, "class": cls, "ids": [rng.randrange(3, 1000) for _ in range(size)]})
        t += rng.expovariate(1 / interval_s)
    return out


async def ttft(stub, ids: list[int], new_tokens: int) -> float:
    t0 = time.perf_counter()
    first = None
    async for _ in stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=new_tokens), timeout=600):
        first = first or time.perf_counter() - t0
    return first


async def run_workload(address: str, requests: list[dict], new_tokens: int) -> dict[str, list[float]]:
    async with grpc_server.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = asyncio.get_running_loop().time()

        async def one(r: dict) -> tuple[str, float]:
            await asyncio.sleep(max(0.0, start + r["at"] - asyncio.get_running_loop().time()))
            return r["class"], await ttft(stub, r["ids"], new_tokens)

        results = await asyncio.gather(*(one(r) for r in requests))
    out: dict[str, list[float]] = {c: [] for c in CLASSES}
    for cls, seconds in results:
        out[cls].append(seconds)
    return out


def routed_counts(metrics_port: int) -> dict[str, float]:
    """The router's stagemesh_router_routed_total, as {"short/preferred": n, ...}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("stagemesh_router_routed_total{"):
            labels, value = line[len("stagemesh_router_routed_total{"):].split("}")
            pairs = dict(p.split("=") for p in labels.split(","))
            counts[f"{pairs['class'].strip(chr(34))}/{pairs['path'].strip(chr(34))}"] = float(value)
    return counts


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def start_mesh(model: str, args: argparse.Namespace, log_dir: Path) -> tuple[LocalMesh, dict[str, str], dict]:
    mesh = LocalMesh(model, log_dir)
    env = stage_env(1)
    scheduler = mesh.spawn("scheduler", ["scheduler", "--model", model, "--registry", "local",
                                         "--registry-port", "0"], env)
    url = f"local://{scheduler.address}"
    common = ["stage", "--model", model, "--port", "0", "--registry", url, "--threads", "1", "--memory-gb", "1",
              "--kv-cache-gb", "0.3", "--port", "0", "--no-prefix-cache"]  # rounds repeat their prompts
    specs = [(f"replica-{i}", [*common, "--layers", "0:8"]) for i in range(args.replicas)]
    if args.tp > 1:
        specs.append(("wide-tp", [*common, "--layers", "0:8", "--tp", str(args.tp), "--host-id", "wide-host",
                                  "--devices", str(args.tp)]))
    else:
        specs += [("wide-0", [*common, "--layers", "0:4"]), ("wide-1", [*common, "--layers", "4:8"])]
    mesh.spawn_together(specs, env)
    routers, metrics_ports = {}, {}
    for i, (mode, threshold) in enumerate((("rule", args.long_prompt_tokens), ("no rule", 0))):
        metrics_ports[mode] = args.metrics_port + i if args.metrics_port else free_port()
        proc = mesh.spawn(f"router-{i}", ["--log-level", "warning", "router", "--model", model, "--registry", url,
                                          "--port", "0", "--long-prompt-tokens", str(threshold),
                                          "--metrics-port", str(metrics_ports[mode]),
                                          "--slots-per-chain", str(args.slots_per_chain)], stage_env(None))
        routers[mode] = proc.address
        wait_for_chains(proc.address, args.replicas + 1)
    return mesh, routers, metrics_ports


def chain_table(address: str) -> list[dict]:
    with grpc.insecure_channel(address) as channel:
        listing = router_pb2_grpc.RouterStub(channel).ListChains(router_pb2.ListChainsRequest(), timeout=10)
    return [{"kind": c.kind, "tp_width": c.tp_width, "length_class": c.length_class, "stages": len(c.stages)}
            for c in listing.chains]


def measure(model: str, args: argparse.Namespace, log_dir: Path) -> dict:
    mesh, routers, metrics_ports = start_mesh(model, args, log_dir)
    try:
        chains = chain_table(routers["rule"])
        print("chains (as the rule's router ranks them): " + "; ".join(
            f"{c['kind']} ({c['stages']} stage(s), tp width {c['tp_width']}) -> {c['length_class']}"
            for c in chains), flush=True)
        warm = workload(4, args.short_tokens, args.long_tokens, 0.05, seed=99)
        for mode in MODES:  # first-use costs paid on every chain
            asyncio.run(run_workload(routers[mode], warm, args.new_tokens))
        before = {mode: routed_counts(metrics_ports[mode]) for mode in MODES}
        ttfts: dict[str, dict[str, list[float]]] = {m: {c: [] for c in CLASSES} for m in MODES}
        rounds = []
        for r in range(args.repeats):
            requests = workload(args.requests, args.short_tokens, args.long_tokens, args.interval_ms / 1000,
                                seed=r)
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                got = asyncio.run(run_workload(routers[mode], requests, args.new_tokens))
                row = {"round": r, "mode": mode,
                       **{f"{c}_median_ms": statistics.median(got[c]) * 1000 for c in CLASSES}}
                rounds.append(row)
                print(f"  round {r} {mode:>7}: short {row['short_median_ms']:.1f} ms, long "
                      f"{row['long_median_ms']:.1f} ms (medians)", flush=True)
                for c in CLASSES:
                    ttfts[mode][c] += got[c]
        after = {mode: routed_counts(metrics_ports[mode]) for mode in MODES}
    finally:
        mesh.stop()
    summary = {mode: {c: {"median_ms": statistics.median(ttfts[mode][c]) * 1000, "p90_ms": p90(ttfts[mode][c]) * 1000,
                          "n": len(ttfts[mode][c])} for c in CLASSES} for mode in MODES}
    routed = {mode: {k: after[mode][k] - before[mode].get(k, 0.0) for k in after[mode]} for mode in MODES}
    return {"chains": chains, "summary": summary, "rounds": rounds, "routed": routed}


def print_report(result: dict, args: argparse.Namespace) -> None:
    print(f"\ntime to first token, ms ({args.requests} requests x {args.repeats} rounds per router; "
          f"short {args.short_tokens} tokens, long {args.long_tokens} tokens, {args.new_tokens} new tokens each)")
    print(f"{'router':>8} | {'short median':>12} {'short p90':>10} | {'long median':>11} {'long p90':>9} | picks")
    for mode in MODES:
        s = result["summary"][mode]
        picks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(result["routed"][mode].items()) if v) or "-"
        print(f"{mode:>8} | {s['short']['median_ms']:>12.1f} {s['short']['p90_ms']:>10.1f} | "
              f"{s['long']['median_ms']:>11.1f} {s['long']['p90_ms']:>9.1f} | {picks}")
    rule, none = result["summary"]["rule"], result["summary"]["no rule"]
    print("rule / no rule: " + ", ".join(f"{c} {q} {rule[c][q] / none[c][q]:.2f}x"
                                         for c in CLASSES for q in ("median_ms", "p90_ms")))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint with >= 2,048 + new tokens of context "
                                                 "(default: models/tiny-llama-4k, made if missing)")
    p.add_argument("--replicas", type=int, default=2, help="whole-model stages beside the wide chain")
    p.add_argument("--tp", type=int, default=1, help="the wide chain is one stage of --tp K ranks (default: a "
                                                     "2-stage pipeline stands in)")
    p.add_argument("--requests", type=int, default=40, help="requests per round (1 in 5 long)")
    p.add_argument("--interval-ms", type=float, default=60.0, help="mean time between arrivals")
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument("--long-prompt-tokens", type=int, default=512, help="the rule's router's threshold")
    p.add_argument("--slots-per-chain", type=int, default=32, help="both routers': streams per chain, past which "
                                                                   "the rule's router counts a chain full")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs the workload through both routers")
    p.add_argument("--metrics-port", type=int, default=0, help="the routers' metrics ports: this and the next "
                                                               "(default: free ones)")
    p.add_argument("--quick", action="store_true", help="a small run (1 replica, 10 requests, 1 round, 1,024-token "
                                                        "long prompts): that it works, not what it measures")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.requests, args.repeats, args.long_tokens, args.interval_ms = 1, 10, 1, 1024, 30.0
    if args.long_tokens <= args.long_prompt_tokens or args.short_tokens > args.long_prompt_tokens:
        p.error("short prompts must be at most --long-prompt-tokens and long ones longer")
    model = args.model or str(tiny_model_4k(Path("models/tiny-llama-4k")))
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as log_dir:
        result = measure(model, args, Path(log_dir))
    print_report(result, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                                        "args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))


if __name__ == "__main__":
    main()
