"""One hop's floor: a grpc.aio bidirectional stream between two processes, as a stage's links and the router's
Sessions streams are, with gRPC's transport as stagemesh sets it and with gRPC's own default, side by side.

    python scripts/dev/bench_hop.py                  # ~1 min: 1 KiB and 64 KiB messages, 5 rounds of each arm in turn

Each round starts an echo server process and times, from a client process, round trips of one message (write,
then read the echo): the median of each round after a warm-up, then the median over rounds. With gRPC's default
(the EventEngine client, listener and endpoints) a message received crosses three threads: an EventEngine
poller reads the socket, grpc.aio's completion-queue thread picks the event up, the event loop runs the
handler. stagemesh turns those experiments off (stagemesh/__init__.py): the completion-queue thread reads the
socket itself. Speed is only measured here, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc import aio  # noqa: E402

from stagemesh.grpc_transport import GRPC_TRANSPORT_EXPERIMENTS  # noqa: E402  (each arm's process gets it in its env)

METHOD = "/stagemesh.bench.Echo/Stream"
ARMS = {"stagemesh": GRPC_TRANSPORT_EXPERIMENTS, "grpc default": ""}  # each process's GRPC_EXPERIMENTS


def _same(b: bytes) -> bytes:
    return b


async def serve() -> None:
    async def echo(requests, _context):
        async for message in requests:
            yield message

    server = aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo, _same, _same)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("stagemesh.bench.Echo",
                                                                          {"Stream": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def round_trips(port: int, size: int, n: int, warm: int) -> float:
    """Median µs of n round trips of a `size`-byte message, after `warm` untimed ones."""
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)()
        message, times = b"x" * size, []
        for i in range(warm + n):
            t = time.perf_counter()
            await call.write(message)
            await call.read()
            if i >= warm:
                times.append(time.perf_counter() - t)
        await call.done_writing()
        return statistics.median(times) * 1e6


def measure(experiments: str, size: int, n: int) -> float:
    """A round in fresh processes (gRPC reads its experiments once, when it loads)."""
    env = {**os.environ, "GRPC_EXPERIMENTS": experiments}
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        out = subprocess.run([sys.executable, __file__, "--client", str(port), "--size", str(size), "--n", str(n)],
                             env=env, capture_output=True, text=True, check=True, timeout=300)
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        server.kill()
        server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,65536", help="message bytes, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=2000, help="timed round trips per round")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    if args.client:
        print(asyncio.run(round_trips(args.client, args.size, args.n, warm=max(100, args.n // 10))))
        return
    print(f"round trip on one grpc.aio stream between two processes, µs (medians of {args.rounds} rounds of "
          f"{args.n}); stagemesh sets GRPC_EXPERIMENTS={GRPC_TRANSPORT_EXPERIMENTS}")
    for size in (int(s) for s in args.sizes.split(",")):
        got: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm in (ARMS if r % 2 == 0 else reversed(ARMS)):  # the arms in turns: the machine drifts
                got[arm].append(measure(ARMS[arm], size, args.n))
        mesh, default = statistics.median(got["stagemesh"]), statistics.median(got["grpc default"])
        print(f"  {size:>7} B: gRPC default {default:7.1f}   stagemesh {mesh:7.1f}   ({default / mesh:.2f}x)   "
              f"rounds: {[round(x) for x in got['grpc default']]} / {[round(x) for x in got['stagemesh']]}")


if __name__ == "__main__":
    main()
