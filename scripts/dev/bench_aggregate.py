"""Aggregate tokens/s of one tree's mesh against another's, side by side in one run: the mixed streams of
bench.py (the same prompts, SEED 1234), no transformers column (bench.py has it), so that a before/after pair
costs minutes, not bench.py's hour on the ~270M model.

    python scripts/dev/bench_aggregate.py --code /tmp/before --code .            # tiny Llama, 2 stages, 32 and 64
    python scripts/dev/bench_aggregate.py --medium --levels 32 --repeats 1 --code /tmp/before --code .
    python scripts/dev/bench_aggregate.py --medium --levels 32 --repeats 1 --also-with=--no-packed-weights

Each --code DIR is a checkout whose stage and router processes run (`python -m stagemesh.cli` from DIR, started
by that tree's own launcher); the trees take turns, --rounds times, each round a fresh mesh that runs each level
--warmup times untimed first (a fresh stage's first sessions also pay for the first touch of its KV pool's
pages). --stage-arg and --router-arg go to every tree's processes; --also-with measures every tree a second time
with more stage flags (an arm per tree and flag set, in the same turns). Prints tokens/s per level, the median
over every run, each tree's ratio to the first, and the streams' time to first token (they all start together).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for bench.py
from bench import Plan, make_workload  # noqa: E402  (scripts/bench.py: its mixed streams, the same draws)

ROOT = Path(__file__).resolve().parents[2]


def worker(a: argparse.Namespace) -> None:
    """In the tree under test (cwd and sys.path): one mesh, every level --repeats times; JSON on the last line."""
    sys.path.insert(0, os.getcwd())
    import grpc
    from transformers import AutoConfig

    from stagemesh.launcher import start_local_mesh
    from stagemesh.stage_server.config import StageConfig
    from stagemesh.v1 import router_pb2, router_pb2_grpc

    config = AutoConfig.from_pretrained(a.model, local_files_only=True)
    plan = Plan(stages=[a.stages], replicas=[1], levels=a.levels, repeats=1, concurrency_repeats=a.repeats)
    streams = make_workload(plan, config.vocab_size, config.max_position_embeddings).streams
    # The repeats send the same prompts: a tree whose stages cache prefixes is told not to, so that every tree
    # computes what it is given.
    uncached = ["--no-prefix-cache"] if "prefix_cache" in StageConfig.__dataclass_fields__ else []
    mesh, router = start_local_mesh(a.model, stages=a.stages, router_port=0, threads=a.stage_threads,
                                    extra_stage_args=[*uncached, *(a.stage_arg or [])],
                                    extra_router_args=a.router_arg or None)

    async def one(stub, ids: list[int], max_new: int, t0: float) -> tuple[int, float]:
        """The stream's tokens and its time to first token (seconds from the level's start)."""
        tokens, first = 0, 0.0
        async for response in stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=max_new)):
            if not tokens and response.token_ids:
                first = time.perf_counter() - t0
            tokens += len(response.token_ids)
        return tokens, first

    async def chain_up(stub) -> None:
        """Until a short stream goes through (bounded): the router has its chain."""
        for _ in range(120):
            try:
                await one(stub, streams[0][0][:32], 4, time.perf_counter())
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(1)

    async def level_run(stub, level: int) -> tuple[list[tuple[int, float]], float]:
        """The level's streams at once: each one's tokens and first-token time, and the seconds they took. A run
        whose chain was taken out under it (UNAVAILABLE: on a machine loaded by other work, the router's probes and
        health checks can time out) runs again, timed afresh, once the chain is back (at most twice, said on
        stderr); any other failure ends the benchmark."""
        for attempt in range(3):
            t0 = time.perf_counter()
            tasks = [asyncio.ensure_future(one(stub, ids, n, t0)) for ids, n in streams[:level]]
            try:
                done = await asyncio.gather(*tasks)
                return done, time.perf_counter() - t0
            except grpc.aio.AioRpcError as exc:
                for task in tasks:  # the run's other streams end with it
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == 2:
                    raise
                print(f"{level} streams: a stream failed ({exc.details()}); the run again once the chain is back",
                      file=sys.stderr, flush=True)
                await chain_up(stub)
        raise AssertionError("unreachable")

    async def run() -> dict[str, list[float]]:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await chain_up(stub)
            out = {}
            for level in a.levels:
                out[str(level)] = {"tok_s": [], "ttft_ms": [], "ttft_p90_ms": []}
                for run in range(a.warmup + a.repeats):
                    done, took = await level_run(stub, level)
                    if run < a.warmup:
                        continue  # untimed: the pool's first touch
                    firsts = sorted(first * 1000 for _, first in done)
                    out[str(level)]["tok_s"].append(sum(tokens for tokens, _ in done) / took)
                    out[str(level)]["ttft_ms"].append(statistics.median(firsts))
                    out[str(level)]["ttft_p90_ms"].append(firsts[int(0.9 * (len(firsts) - 1))])
            return out

    try:
        print(json.dumps(asyncio.run(run())))
    finally:
        mesh.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--medium", action="store_true", help="the ~270M Llama of bench.py --medium (models/llama-270m)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64])
    p.add_argument("--repeats", type=int, default=3, help="runs of each level per mesh")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs of each level first (a fresh stage's first sessions also pay for its KV "
                        "pool's first touch, which a VM's host may back slowly: docs/decisions.md, "
                        "'A fresh pool's first touch')")
    p.add_argument("--rounds", type=int, default=1, help="times each tree gets a fresh mesh, in turns")
    p.add_argument("--code", action="append", type=Path, default=[], help="a checkout to measure (repeatable)")
    p.add_argument("--stage-threads", type=int, default=None,
                   help="torch threads per stage process (default: the CPUs shared among the mesh's stages)")
    p.add_argument("--stage-arg", action="append", default=[], metavar="FLAG", help="e.g. --stage-arg=--compile")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="e.g. --router-arg=--slots-per-chain=64")
    p.add_argument("--also-with", action="append", default=[], metavar="FLAG",
                   help="measure each tree again with these stage flags too, in turns "
                        "(e.g. --also-with=--no-packed-weights)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.medium:
        a.model = str(ROOT / "models" / "llama-270m")
    if a.worker:
        return worker(a)
    if not Path(a.model).exists():
        sys.exit(f"no model at {a.model}: make it with scripts/make_tiny_model.py (bench.py --medium makes the ~270M)")
    # Each arm: a tree, and the stage flags it runs with besides --stage-arg's.
    arms = [(c.resolve(), extra) for extra in ([[]] + ([a.also_with] if a.also_with else []))
            for c in (a.code or [ROOT])]
    runs: list[dict[str, dict[str, list[float]]]] = [{} for _ in arms]
    flags = [f"--stage-arg={x}" for x in a.stage_arg] + [f"--router-arg={x}" for x in a.router_arg]
    for _ in range(a.rounds):
        for i, (tree, extra) in enumerate(arms):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", a.model, "--stages",
                   str(a.stages), "--levels", ",".join(map(str, a.levels)), "--repeats", str(a.repeats),
                   "--warmup", str(a.warmup), *flags,
                   *(["--stage-threads", str(a.stage_threads)] if a.stage_threads else []),
                   *(f"--stage-arg={x}" for x in extra)]
            proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{tree}: the mesh run failed:\n{proc.stderr[-3000:]}")
            for level, values in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                for key, v in values.items():
                    runs[i].setdefault(level, {}).setdefault(key, []).extend(v)
            print(f"  {tree} {' '.join(extra)}: {json.dumps(runs[i])}", flush=True)
    print(f"aggregate tokens/s, {a.stages}-stage chain of {Path(a.model).name}, bench.py's mixed streams, "
          f"{a.rounds} round(s) x {a.repeats} run(s): median [runs], x the first tree; time to first token "
          f"(all streams start together): the median of the runs' medians and of their 90th percentiles")
    base = {level: statistics.median(v["tok_s"]) for level, v in runs[0].items()}
    for (tree, extra), tree_runs in zip(arms, runs, strict=True):
        cells = [f"{level} streams {statistics.median(v['tok_s']):.1f} [{', '.join(f'{x:.0f}' for x in v['tok_s'])}] "
                 f"{statistics.median(v['tok_s']) / base[level]:.2f}x, first token "
                 f"{statistics.median(v['ttft_ms']):.0f} ms (p90 {statistics.median(v['ttft_p90_ms']):.0f})"
                 for level, v in tree_runs.items()]
        print(f"  {tree} {' '.join(extra)}\n    " + "\n    ".join(cells))


if __name__ == "__main__":
    main()
