"""Time from a stage's failure to the next token: repair (router/repair.py) against replaying the whole
prefix on another chain, side by side in one run.

    python scripts/bench_repair.py [--modes relay,forwarding] [--positions first,middle,last] [--prefixes 64,512,2048]
                                   [--repeats 5] [--threads 1]

Two chains of three stage processes with the same layer ranges (a tiny random Llama made for the run, 8
layers, context 4096), each stage behind a link proxy (tests/harness/link_proxy.py). The benchmark drives
the router's own session code (router.chain_client, router.repair) on chain A: a prefix of P tokens, 4
decode steps, then the link to one of A's stages (--positions: first, middle, last) is cut (its connections reset,
new ones refused: what a SIGKILLed stage looks like to the router and to the stage before it) and the clock starts.
The next step fails there, and then

    repair: chain B's stage of the same layers takes the dead one's place, rebuilt from the previous stage's
            output log (token ids for a first stage; P + 4 positions, in prefill chunks of 256); the stages after
            it take the one position they lack; the token comes back
    replay: a new session on chain B, the whole prefix and the 4 tokens in pipelined chunks of 256 through
            all three stages (generation.py's failover)

until the token of that step is back. Modes alternate; per prefix, the median over --repeats, and the ratio.
The tokens of both modes are checked equal.

--modes: the data paths measured. relay: every hop through the router (ChainSession, repair.repair);
forwarding: stages send hidden states on themselves (ForwardingSession, repair.forwarding_repair: chain B's
middle stage rebuilt on its own stream, every stage rewound to before the failed step and stage 1 re-pointed
at it, the step sent again; replay: a forwarding session on chain B).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import torch  # noqa: E402

from stagemesh.router import repair  # noqa: E402
from stagemesh.router.chain_client import Chain, ChainSession, StageEndpoint  # noqa: E402
from stagemesh.router.forwarding import ForwardingSession  # noqa: E402
from stagemesh.router.step_values import Sampling  # noqa: E402
from stagemesh.tiny_model import make_tiny_model  # noqa: E402
from stagemesh.v1 import stage_pb2  # noqa: E402
from tests.harness.fault_mesh import FaultMesh  # noqa: E402

MODES = ("repair", "replay")
CHUNK = 256
DECODED = 4


def endpoints(pm: FaultMesh, chain: int) -> list[StageEndpoint]:
    per = pm.per_chain
    return [StageEndpoint(link.address, a, b) for link, (a, b) in
            zip(pm.links[chain * per:(chain + 1) * per], pm.layers[chain * per:(chain + 1) * per], strict=True)]


async def serving(stages: list[StageEndpoint], timeout_s: float = 180) -> None:
    """Every stage answers (started, or reachable again after a cut: gRPC shares a connection's backoff
    between channels of one process)."""
    deadline = time.monotonic() + timeout_s
    for stage in stages:
        while True:
            try:
                await stage.stub.Info(stage_pb2.InfoRequest(), timeout=2)
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def forwarding_ready(chain: Chain, timeout_s: float = 60) -> None:
    """A one-token forwarding session goes through the chain (a stage's link to the next one may still be in
    gRPC's reconnect backoff after the last cut)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with ForwardingSession(chain, 8, "bench-warmup") as session:
                await session.step([5], sampling=Sampling())
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


POSITIONS = {"first": 0, "middle": 1, "last": 2}


async def one_failure(pm: FaultMesh, path: str, mode: str, prefix: list[int], victim: int) -> tuple[float, int]:
    """(seconds from the cut to the next token, that token) on data path `path` (relay or forwarding), chain A's
    stage `victim` failing."""
    session_type = ForwardingSession if path == "forwarding" else ChainSession
    chain_a, chain_b = Chain(endpoints(pm, 0)), Chain(endpoints(pm, 1))
    await serving([*chain_a.stages, *chain_b.stages])
    if path == "forwarding":
        for chain in (chain_a, chain_b):
            await forwarding_ready(chain)
    greedy = Sampling()
    max_length = len(prefix) + DECODED + 8
    async with session_type(chain_a, max_length, f"bench-{mode}", keep_output=mode == "repair") as session:
        feed, history = prefix, list(prefix)
        for _ in range(DECODED):
            token = (await session.step(feed, sampling=greedy, chunk_size=CHUNK)).token_id
            history.append(token)
            feed = [token]
        pm.links[victim].set(cut=True)
        t0 = time.perf_counter()
        try:
            await session.step(feed, sampling=greedy, chunk_size=CHUNK)
            raise RuntimeError("the step through a cut link succeeded")
        except grpc.aio.AioRpcError:
            pass
        if mode == "repair":
            rebuild = repair.forwarding_repair if path == "forwarding" else repair.repair
            result = await rebuild(session, chain_b.stages[victim], history, CHUNK)
        else:
            async with session_type(chain_b, max_length, "bench-replay-2") as other:
                result = await other.step(history, sampling=greedy, chunk_size=CHUNK)
        took = time.perf_counter() - t0
    pm.links[victim].set()
    for stage in (*chain_a.stages, *chain_b.stages):
        await stage.close()
    return took, result.token_id


async def run(pm: FaultMesh, paths: list[str], positions: list[str], prefixes: list[int], repeats: int) -> list[dict]:
    rows = []
    for path, where, p in [(path, where, p) for path in paths for where in positions for p in prefixes]:
        prefix = torch.randint(4, 1000, (p,), generator=torch.Generator().manual_seed(p)).tolist()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        tokens: set[int] = set()
        for _ in range(repeats):
            for mode in MODES:
                took, token = await one_failure(pm, path, mode, prefix, POSITIONS[where])
                times[mode].append(took)
                tokens.add(token)
                await asyncio.sleep(0.3)
        if len(tokens) != 1:
            raise RuntimeError(f"{where} stage, prefix {p}: the modes disagree on the next token: {tokens}")
        row = {"path": path, "stage": where, "prefix": p,
               **{f"{m}_ms": round(statistics.median(times[m]) * 1000, 1) for m in MODES}}
        row["replay/repair"] = round(row["replay_ms"] / row["repair_ms"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="relay,forwarding", help="data paths: relay, forwarding")
    parser.add_argument("--positions", default="first,middle,last", help="the stage of chain A that fails")
    parser.add_argument("--prefixes", default="64,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    parser.add_argument("--log-dir", default="", help="keep the processes' logs here (default: a temporary folder)")
    args = parser.parse_args()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    paths = args.modes.split(",")
    if not set(paths) <= {"relay", "forwarding"}:
        parser.error(f"--modes {args.modes!r}: relay and/or forwarding")
    positions = args.positions.split(",")
    if not set(positions) <= set(POSITIONS):
        parser.error(f"--positions {args.positions!r}: first, middle and/or last")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama", layers=8, seed=7, max_position=4096)
        logs = Path(args.log_dir or Path(tmp) / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        pm = FaultMesh(str(model), logs, chains=2, stages=3, num_layers=8,
                       # --no-prefix-cache: a replay after the repeats before it would find the prefix cached
                       stage_args=("--kv-cache-gb", "0.1", "--threads", str(args.threads), "--no-prefix-cache"))
        try:
            rows = asyncio.run(run(pm, paths, positions, prefixes, args.repeats))
        finally:
            pm.stop()
    print("| data path | stage killed | prefix tokens | repair (ms) | replay on another chain (ms) | replay / repair |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['path']} | {r['stage']} | {r['prefix']} | {r['repair_ms']} | {r['replay_ms']} | "
              f"{r['replay/repair']}x |")


if __name__ == "__main__":
    main()
