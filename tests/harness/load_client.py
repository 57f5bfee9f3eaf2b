"""Greedy requests back to back against a router, each outcome one JSON line in a file, and the router's healthy
chains sampled beside them: the load of the namespace fault tests, run as its own process on a host (the test's
own process, in the root namespace, cannot reach the hosts' addresses). It stops when the --stop file appears, or
after --max-s. With --prompts (a JSON list of token id lists) each request takes one of them at random, and its
record names which ("prompt": its index), so that a reader can check each answer against its own reference.

    python -m tests.harness.load_client --router 10.77.0.1:50051 --tls DIR --out load.jsonl --stop stop
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import grpc

from stagemesh import tls
from stagemesh.v1 import router_pb2, router_pb2_grpc

PROMPT = [5, 6, 7, 8]


class Log:
    """JSON lines, written whole and flushed one by one, so that a reader between phases sees complete lines."""

    def __init__(self, path: Path):
        self._file = path.open("a")
        self._lock = threading.Lock()

    def write(self, **record: object) -> None:
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()


def _requests(stub: router_pb2_grpc.RouterStub, log: Log, done: threading.Event, prompts: list[list[int]],
              rng: random.Random, max_new_tokens: int, timeout_s: float) -> None:
    while not done.is_set():
        k = rng.randrange(len(prompts))
        request = router_pb2.GenerateRequest(token_ids=prompts[k], max_new_tokens=max_new_tokens)
        start, first, tokens = time.time(), None, []
        try:
            for response in stub.Generate(request, timeout=timeout_s):
                first = first or time.time()
                tokens.extend(response.token_ids)
            log.write(kind="request", start=start, end=time.time(), first=first, tokens=tokens, error="", prompt=k)
        except grpc.RpcError as exc:
            log.write(kind="request", start=start, end=time.time(), first=first, tokens=tokens,
                      error=f"{exc.code().name}: {exc.details()}", prompt=k)


def _chains(stub: router_pb2_grpc.RouterStub, log: Log, done: threading.Event, every_s: float) -> None:
    while not done.wait(every_s):
        try:
            chains = stub.ListChains(router_pb2.ListChainsRequest(), timeout=2).chains
            log.write(kind="chains", t=time.time(), listed=len(chains),
                      healthy=sorted(">".join(s.address for s in c.stages) for c in chains if c.healthy))
        except grpc.RpcError as exc:
            log.write(kind="chains", t=time.time(), healthy=None, listed=0, error=exc.code().name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True)
    p.add_argument("--tls", required=True, help="the mesh's --tls directory: the router's certificate is checked")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--stop", required=True, type=Path, help="stop once this file exists")
    p.add_argument("--streams", type=int, default=2, help="requests in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=30.0, help="each request's deadline")
    p.add_argument("--max-s", type=float, default=300.0, help="stop after this long whatever happens")
    p.add_argument("--prompts", type=Path, default=None, help="a JSON list of prompts (token id lists) to draw from")
    p.add_argument("--seed", type=int, default=0, help="of the draws from --prompts")
    args = p.parse_args()
    prompts = json.loads(args.prompts.read_text()) if args.prompts else [PROMPT]
    log, done = Log(args.out), threading.Event()
    with grpc.secure_channel(args.router, tls.load(args.tls).channel_credentials()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        workers = [threading.Thread(target=_requests, args=(stub, log, done, prompts, random.Random(args.seed + i),
                                                            args.max_new_tokens, args.timeout_s))
                   for i in range(args.streams)]
        workers.append(threading.Thread(target=_chains, args=(stub, log, done, 0.25)))
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + args.max_s
        while not args.stop.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        done.set()
        for worker in workers:
            worker.join()


if __name__ == "__main__":
    main()
