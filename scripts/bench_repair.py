"""Time from a stage's failure to the next token: repair (router/repair.py) against replaying the whole
prefix on another chain, side by side in one run.

    python scripts/bench_repair.py [--positions 0,1,2] [--prefixes 64,512,2048] [--repeats 5] [--threads 1]

Two chains of three stage processes with the same layer ranges (a tiny random Llama made for the run, 8
layers, context 4096), each stage behind a link proxy (tests/harness/link_proxy.py). The benchmark drives
the router's own session code (router.session, router.repair) on chain A: a prefix of P tokens, 4
decode steps, then the link to A's stage at --positions (0: the first, 1: the middle, 2: the last) is cut
(its connections reset, new ones refused: what a SIGKILLed stage looks like to the router) and the clock
starts. The next step fails there, and then

    repair: chain B's stage of that position takes the dead one's place, rebuilt on its own stream from the
            previous stage's output log (token ids for a first stage; P + 4 positions, in prefill chunks of
            256); every stage is rewound to before the failed step, the one before the new stage re-pointed at
            it, and the step sent again
    replay: a new session on chain B, the whole prefix and the 4 tokens in pipelined chunks of 256 through
            all three stages (generation.py's failover)

until the token of that step is back. Modes alternate; per prefix, the median over --repeats, and the ratio.
The tokens of both modes are checked equal.

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
from stagemesh.router.chain_client import Chain, StageEndpoint  # noqa: E402
from stagemesh.router.session import ChainSession  # noqa: E402
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


async def ready(chain: Chain, timeout_s: float = 60) -> None:
    """A one-token session goes through the chain (a stage's link to the next one may still be in
    gRPC's reconnect backoff after the last cut)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with ChainSession(chain, 8, "bench-warmup") as session:
                await session.step([5], sampling=Sampling())
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def one_failure(pm: FaultMesh, victim: int, mode: str, prefix: list[int]) -> tuple[float, int]:
    """(seconds from the cut to the next token, that token) when chain A's stage `victim` fails."""
    chain_a, chain_b = Chain(endpoints(pm, 0)), Chain(endpoints(pm, 1))
    await serving([*chain_a.stages, *chain_b.stages])
    for chain in (chain_a, chain_b):
        await ready(chain)
    greedy = Sampling()
    max_length = len(prefix) + DECODED + 8
    async with ChainSession(chain_a, max_length, f"bench-{mode}", keep_output=mode == "repair") as session:
        feed, history = prefix, list(prefix)
        for _ in range(DECODED):
            token = (await session.step(feed, sampling=greedy, chunk_size=CHUNK)).token_id
            history.append(token)
            feed = [token]
        pm.links[victim].set(cut=True)  # chain A's stages come first in pm.links
        t0 = time.perf_counter()
        try:
            await session.step(feed, sampling=greedy, chunk_size=CHUNK)
            raise RuntimeError("the step through a cut link succeeded")
        except grpc.aio.AioRpcError:
            pass
        if mode == "repair":
            result = await repair.repair(session, chain_b.stages[victim], history, CHUNK)
        else:
            async with ChainSession(chain_b, max_length, "bench-replay-2") as other:
                result = await other.step(history, sampling=greedy, chunk_size=CHUNK)
        took = time.perf_counter() - t0
    pm.links[victim].set()
    for stage in (*chain_a.stages, *chain_b.stages):
        await stage.close()
    return took, result.token_id


async def run(pm: FaultMesh, positions: list[int], prefixes: list[int], repeats: int) -> list[dict]:
    rows = []
    for position, p in [(position, p) for position in positions for p in prefixes]:
        prefix = torch.randint(4, 1000, (p,), generator=torch.Generator().manual_seed(p)).tolist()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        tokens: set[int] = set()
        for _ in range(repeats):
            for mode in MODES:
                took, token = await one_failure(pm, position, mode, prefix)
                times[mode].append(took)
                tokens.add(token)
                await asyncio.sleep(0.3)
        if len(tokens) != 1:
            raise RuntimeError(f"prefix {p}: the modes disagree on the next token: {tokens}")
        row = {"position": position, "prefix": p,
               **{f"{m}_ms": round(statistics.median(times[m]) * 1000, 1) for m in MODES}}
        row["replay/repair"] = round(row["replay_ms"] / row["repair_ms"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", default="0,1,2", help="which stage of the three fails (0: the first)")
    parser.add_argument("--prefixes", default="64,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    parser.add_argument("--log-dir", default="", help="keep the processes' logs here (default: a temporary folder)")
    args = parser.parse_args()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    if not set(positions) <= {0, 1, 2}:
        parser.error(f"--positions {args.positions!r}: 0, 1 and/or 2")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama", layers=8, seed=7, max_position=4096)
        logs = Path(args.log_dir or Path(tmp) / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        pm = FaultMesh(str(model), logs, chains=2, stages=3, num_layers=8,
                       # --no-prefix-cache: a replay after the repeats before it would find the prefix cached
                       stage_args=("--kv-cache-gb", "0.1", "--threads", str(args.threads), "--no-prefix-cache"))
        try:
            rows = asyncio.run(run(pm, positions, prefixes, args.repeats))
        finally:
            pm.stop()
    print("| failed stage | prefix tokens | repair (ms) | replay on another chain (ms) | replay / repair |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['position']} | {r['prefix']} | {r['repair_ms']} | {r['replay_ms']} | {r['replay/repair']}x |")


if __name__ == "__main__":
    main()
