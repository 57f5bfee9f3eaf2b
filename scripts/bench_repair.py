"""Time from a stage's failure to the next token: repair (router/repair.py) against replaying the whole
prefix on another chain, side by side in one run.

    python scripts/bench_repair.py [--positions 0,1,2] [--prefixes 64,512,2048] [--repeats 5] [--threads 1]
                                   [--prefix-cache [--cached-on-b]]

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

Without --prefix-cache the stages run with --no-prefix-cache: nothing is attached anywhere, and the figures are
those of a mesh without the cache (or of a prefix no request sent before). With --prefix-cache the stages keep
their prefix caches on, and each failure is what a request that follows an earlier one with the same prefix
meets (a conversation's next turn; a shared system prompt):

    before: the prefix was sent once on chain A (a session opened with prefix_ids, as generation.py opens
            them), so chain A's stages hold its full blocks; the measured session is opened on chain A with
            prefix_ids = its history less the last token (as generation.py does) and attaches them
    repair: the session attached cached positions, so no stage logged them: the new stage attaches what its
            own prefix cache holds of them (under chain A's salt), and when that is not all, the stages before
            it are rewound and compute the rest again into it (router/repair.py); a new first stage is fed token
            ids past what it attached
    replay: the new session on chain B is opened with prefix_ids, as generation.py's failover opens it, and
            attaches whatever chain B's stages hold of the prefix: by default nothing (the earlier request
            went to chain A only: the router does not route by prefix); with --cached-on-b the prefix was
            sent once on chain B as well (a system prompt both chains have served), and the replay attaches
            it and computes only the rest

Each failure uses its own cache scope (ChainSession's cache_scope, part of every block's key), so neither the
repeats before it nor the other mode leave blocks it finds: what is cached is what "before" put there. The
positions attached (chain A's session, chain B's replay) are printed with each row.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
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


async def send_once(chain: Chain, prefix: list[int], scope: str) -> None:
    """An earlier request with the same prefix on chain: its stages cache the prefix's full blocks under
    scope (a session opened with prefix_ids registers the blocks it computes)."""
    async with ChainSession(chain, len(prefix) + 1, "bench-earlier", prefix_ids=prefix[:-1],
                            cache_scope=scope) as session:
        await session.step(prefix[session.position:], sampling=Sampling(), chunk_size=CHUNK)


async def one_failure(pm: FaultMesh, victim: int, mode: str, prefix: list[int], cached_on: tuple[int, ...]
                      ) -> tuple[float, int, dict[str, int]]:
    """(seconds from the cut to the next token, that token, positions attached from prefix caches) when chain A's
    stage `victim` fails; the prefix sent once before on the chains in cached_on (0: A, 1: B; none: the stages
    run without the cache)."""
    chain_a, chain_b = Chain(endpoints(pm, 0)), Chain(endpoints(pm, 1))
    await serving([*chain_a.stages, *chain_b.stages])
    for chain in (chain_a, chain_b):
        await ready(chain)
    greedy = Sampling()
    max_length = len(prefix) + DECODED + 8
    scope = f"bench-{secrets.token_hex(8)}" if cached_on else ""  # this failure's blocks only
    for index in cached_on:
        await send_once((chain_a, chain_b)[index], prefix, scope)
    attached: dict[str, int] = {}
    async with ChainSession(chain_a, max_length, f"bench-{mode}", keep_output=mode == "repair",
                            prefix_ids=prefix[:-1] if cached_on else None, cache_scope=scope) as session:
        if cached_on:
            attached["a"] = session.attached
            if not session.attached:
                raise RuntimeError(f"chain A attached none of the {len(prefix)}-token prefix sent on it before")
        feed, history = prefix[session.position:], list(prefix)
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
        else:  # as generation.py's failover opens it: what chain B holds of the history is attached
            async with ChainSession(chain_b, max_length, "bench-replay-2",
                                    prefix_ids=history[:-1] if cached_on else None, cache_scope=scope) as other:
                result = await other.step(history[other.position:], sampling=greedy, chunk_size=CHUNK)
            if cached_on:
                attached["b"] = other.attached
        took = time.perf_counter() - t0
    pm.links[victim].set()
    for stage in (*chain_a.stages, *chain_b.stages):
        await stage.close()
    return took, result.token_id, attached


async def run(pm: FaultMesh, positions: list[int], prefixes: list[int], repeats: int,
              cached_on: tuple[int, ...]) -> list[dict]:
    rows = []
    for position, p in [(position, p) for position in positions for p in prefixes]:
        prefix = torch.randint(4, 1000, (p,), generator=torch.Generator().manual_seed(p)).tolist()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        tokens: dict[int, list[str]] = {}
        attached: dict[str, set[int]] = {}
        for repeat in range(repeats):
            for mode in MODES:
                took, token, got = await one_failure(pm, position, mode, prefix, cached_on)
                times[mode].append(took)
                tokens.setdefault(token, []).append(f"{mode}#{repeat}")
                for chain, n in got.items():
                    attached.setdefault(chain, set()).add(n)
                await asyncio.sleep(0.3)
        if len(tokens) != 1:
            raise RuntimeError(f"stage {position}, prefix {p}: the next token differs between runs: {tokens}")
        row = {"position": position, "prefix": p,
               **{f"{m}_ms": round(statistics.median(times[m]) * 1000, 1) for m in MODES}}
        row["replay/repair"] = round(row["replay_ms"] / row["repair_ms"], 2)
        row.update({f"attached_{chain}": sorted(n) for chain, n in sorted(attached.items())})
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
    parser.add_argument("--prefix-cache", action="store_true",
                        help="stages keep their prefix caches on, and the prefix was sent once before on chain A")
    parser.add_argument("--cached-on-b", action="store_true",
                        help="with --prefix-cache: the prefix was sent on chain B as well (the replay attaches it)")
    args = parser.parse_args()
    if args.cached_on_b and not args.prefix_cache:
        parser.error("--cached-on-b needs --prefix-cache")
    cached_on = ((0, 1) if args.cached_on_b else (0,)) if args.prefix_cache else ()
    prefixes = [int(p) for p in args.prefixes.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    if not set(positions) <= {0, 1, 2}:
        parser.error(f"--positions {args.positions!r}: 0, 1 and/or 2")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama", layers=8, seed=7, max_position=4096)
        logs = Path(args.log_dir or Path(tmp) / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        # Without --prefix-cache the cache is off: a replay after the repeats before it would find the prefix cached.
        cache = () if args.prefix_cache else ("--no-prefix-cache",)
        pm = FaultMesh(str(model), logs, chains=2, stages=3, num_layers=8,
                       stage_args=("--kv-cache-gb", "0.1", "--threads", str(args.threads), *cache))
        try:
            rows = asyncio.run(run(pm, positions, prefixes, args.repeats, cached_on))
        finally:
            pm.stop()
    where = "chains A and B" if args.cached_on_b else "chain A"
    print(f"prefix cache: on, the prefix sent once before on {where}" if args.prefix_cache else "prefix cache: off")
    print("| failed stage | prefix tokens | repair (ms) | replay on another chain (ms) | replay / repair |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['position']} | {r['prefix']} | {r['repair_ms']} | {r['replay_ms']} | {r['replay/repair']}x |")


if __name__ == "__main__":
    main()
