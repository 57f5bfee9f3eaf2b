"""Prefix caching: requests that share a long system prompt, through a real mesh with the stages' prefix cache on
and off (--no-prefix-cache), side by side in one run.

    python scripts/bench_prefix.py                  # tiny Llama, 2-stage chain of 1-thread stages, ~2 min on 2 cores
    python scripts/bench_prefix.py --medium --system 1024 --requests 6

Each request is the same SYSTEM-token prompt followed by USER tokens of its own, asking NEW tokens. Measured per
mesh: time to first token of requests sent one after another (medians; the first request, which fills the cache,
is reported apart), and the wall time of CONCURRENT such requests at once; with the stages' prefix hits
(Stage/Info kv_prefix_hit_positions). Both meshes stream the same tokens (checked).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402

from scripts import bench  # noqa: E402
from stagemesh.launcher import start_local_mesh  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc  # noqa: E402

FIRST_ORDINARY_ID = 4


async def one(stub, ids: list[int], new: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the tokens)."""
    t0, ttft, tokens = time.perf_counter(), 0.0, []
    async for r in stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=new), timeout=1800):
        if not tokens and r.token_ids:
            ttft = time.perf_counter() - t0
        tokens.extend(r.token_ids)
    return ttft, tokens


async def drive(address: str, stages: list[str], prompts: list[list[int]], concurrent: list[list[int]],
                new: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        sequential = [await one(stub, ids, new) for ids in prompts]
        t0 = time.perf_counter()
        together = await asyncio.gather(*(one(stub, ids, new) for ids in concurrent))
        wall = time.perf_counter() - t0
    hits = []
    for a in stages:
        async with grpc.aio.insecure_channel(a) as channel:
            hits.append((await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10))
                        .kv_prefix_hit_positions)
    ttfts = [t for t, _ in sequential]
    return {"first_ttft_s": ttfts[0], "ttft_s": ttfts[1:], "median_ttft_s": statistics.median(ttfts[1:]),
            "concurrent_wall_s": wall, "concurrent_ttft_s": [t for t, _ in together],
            "tokens": [t for _, t in sequential] + [t for _, t in together], "prefix_hit_positions": hits}


def run_mesh(model: str, stages: int, extra: list[str], prompts, concurrent, new: int, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh, router = start_local_mesh(model, stages=stages, threads=1, router_port=0, log_dir=log_dir,
                                    extra_stage_args=["--device", "cpu", "--kv-cache-gb", "1", *extra],
                                    ready_timeout_s=bench.READY_TIMEOUT_S)
    try:
        addresses = [p.address for p in mesh.processes if p.name.startswith("stage")]
        return asyncio.run(drive(router.address, addresses, prompts, concurrent, new))
    finally:
        bench.uninterrupted(mesh.stop)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--medium", action="store_true", help="the ~270M Llama (models/llama-270m, made if missing)")
    p.add_argument("--model", default="", help="a local checkpoint instead")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    p.add_argument("--user", type=int, default=32, help="tokens of each request's own part")
    p.add_argument("--new", type=int, default=8, help="new tokens per request")
    p.add_argument("--requests", type=int, default=9, help="requests one after another (the first fills the cache)")
    p.add_argument("--concurrent", type=int, default=8, help="requests at once, after those")
    p.add_argument("--out", type=Path, default=Path("bench-out") / "prefix.json")
    args = p.parse_args(argv)
    model = args.model or bench.resolve_model(bench.parse_args(["--medium"] if args.medium else []))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    system = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(args.system)]
    user = lambda: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(args.user)]  # noqa: E731
    prompts = [system + user() for _ in range(args.requests)]
    concurrent = [system + user() for _ in range(args.concurrent)]

    report = {"args": {k: str(v) for k, v in vars(args).items()}, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-prefix-") as tmp:
        for name, extra in (("off", ["--no-prefix-cache"]), ("on", [])):
            print(f"prefix cache {name}: {args.stages}-stage chain, {args.requests} + {args.concurrent} requests of "
                  f"{args.system} shared + {args.user} own tokens", flush=True)
            report[name] = run_mesh(model, args.stages, extra, prompts, concurrent, args.new, Path(tmp) / name)
    off, on = report["off"], report["on"]
    same = off["tokens"] == on["tokens"]
    print(f"\n{'':34} {'cache off':>10} {'cache on':>10} {'off / on':>9}")
    rows = [("first request's TTFT, ms", off["first_ttft_s"] * 1e3, on["first_ttft_s"] * 1e3),
            ("median TTFT of the rest, ms", off["median_ttft_s"] * 1e3, on["median_ttft_s"] * 1e3),
            (f"{args.concurrent} at once: wall time, ms", off["concurrent_wall_s"] * 1e3,
             on["concurrent_wall_s"] * 1e3),
            (f"{args.concurrent} at once: median TTFT, ms", statistics.median(off["concurrent_ttft_s"]) * 1e3,
             statistics.median(on["concurrent_ttft_s"]) * 1e3)]
    for label, a, b in rows:
        print(f"{label:34} {a:10.1f} {b:10.1f} {a / b:8.2f}x")
    print(f"prefix positions the stages did not compute: off {off['prefix_hit_positions']}, "
          f"on {on['prefix_hit_positions']}; the same tokens with the cache on and off: {same}")
    report["same_tokens"] = same
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    if not same:
        raise SystemExit("the meshes streamed different tokens")


if __name__ == "__main__":
    main()
