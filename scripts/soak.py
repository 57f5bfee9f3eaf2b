"""Soak: N minutes of mixed traffic through a 2x2 mesh of real processes, with one fault injected
every minute (SIGKILL, SIGSTOP, a cut, a black hole, a 200 ms delay, garbage bytes, in turn, each held
for a while and then healed). Every greedy answer is checked against transformers' greedy generate().

Prints, every `--report-s` seconds: RSS per process, open sessions and KV bytes per stage, completed
and failed streams, mismatches. Ends with a JSON summary (also written to --out) and exits non-zero if
any stream was lost (failed or wrong).

    python scripts/soak.py --minutes 30                 # the docs' soak run (docs/performance.md)
    python scripts/soak.py --minutes 2 --fault-every-s 20   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import grpc  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from stagemesh import grpc_server  # noqa: E402
from stagemesh.tiny_model import make_tiny_model  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tests.harness.fault_mesh import FAULTS, FaultMesh  # noqa: E402

FAULT_HELD_S = 8.0


def reference(model_dir: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            out.append(gen[0, len(p):].tolist())
    return out


class Tally:
    def __init__(self) -> None:
        self.completed = 0
        self.failed: collections.Counter[str] = collections.Counter()
        self.mismatched = 0


async def caller(stub, prompts, expected, tally: Tally, stop_at: float, rng: random.Random) -> None:
    """A loop of requests: greedy ones checked token for token, seeded sampled ones for length."""
    while time.monotonic() < stop_at:
        k = rng.randrange(len(prompts))
        sampled = rng.random() < 0.25
        want = len(expected[k])
        request = router_pb2.GenerateRequest(token_ids=prompts[k], max_new_tokens=want, priority=rng.choice([-1, 0, 1]))
        if sampled:
            request.temperature, request.top_k, request.seed = 0.8, 40, rng.randrange(2**32)
        try:
            got = [t async for r in stub.Generate(request, timeout=120) for t in r.token_ids]
        except grpc.aio.AioRpcError as exc:
            tally.failed[exc.code().name] += 1
            continue
        tally.completed += 1
        if (not sampled and got != expected[k]) or len(got) > want:
            tally.mismatched += 1


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = None
    return out


async def soak(args) -> dict:
    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp(prefix="soak-")) / "tiny-llama", "llama"))
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(4, 1000, (int(rng.uniform(4, 120)),), generator=gen).tolist() for _ in range(16)]
    expected = reference(model, prompts, args.new_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="soak-logs-"))
    mesh = FaultMesh(model, log_dir, num_layers=8, stage_args=("--kv-cache-gb", "0.05", "--stall-timeout-s", "10"),
                     router_args=("--health-interval-s", "0.5", "--step-timeout-s", "3"))
    tally, samples, faults_done = Tally(), [], []
    t0 = time.monotonic()
    stop_at = t0 + args.minutes * 60
    try:
        async with grpc_server.insecure_channel(mesh.router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            callers = [asyncio.ensure_future(caller(stub, prompts, expected, tally, stop_at, random.Random(i)))
                       for i in range(args.callers)]
            next_fault, next_report, n = t0 + args.fault_every_s, t0, 0
            while time.monotonic() < stop_at:
                now = time.monotonic()
                if now >= next_fault:
                    fault = FAULTS[n % len(FAULTS)]
                    stage = await asyncio.to_thread(mesh.busy_stage, n % 2)
                    await asyncio.to_thread(mesh.inject, fault, stage)
                    await asyncio.sleep(FAULT_HELD_S)
                    await asyncio.to_thread(mesh.heal, fault, stage)
                    faults_done.append({"at_s": round(now - t0), "fault": fault, "stage": stage})
                    n += 1
                    next_fault += args.fault_every_s
                if now >= next_report:
                    pids = {p.name: p.popen.pid for p in (*mesh.stages, mesh.router)}
                    sessions = await asyncio.to_thread(mesh.open_sessions)
                    sample = {"t_s": round(now - t0), "rss_mib": rss_mib(pids), "sessions_kv": sessions,
                              "completed": tally.completed, "failed": dict(tally.failed),
                              "mismatched": tally.mismatched}
                    samples.append(sample)
                    print(json.dumps(sample), flush=True)
                    next_report += args.report_s
                await asyncio.sleep(0.5)
            await asyncio.gather(*callers)
            await asyncio.sleep(2)
            final_sessions = await asyncio.to_thread(mesh.open_sessions)
            alive = mesh.alive()
    finally:
        mesh.stop()
    first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
    return {
        "minutes": args.minutes, "callers": args.callers, "faults": faults_done,
        "completed": tally.completed, "failed": dict(tally.failed), "mismatched": tally.mismatched,
        "final_sessions_kv": final_sessions, "all_processes_alive": all(alive),
        "rss_mib_first": first["rss_mib"], "rss_mib_last": last["rss_mib"], "logs": str(log_dir),
        "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--fault-every-s", type=float, default=60.0)
    p.add_argument("--report-s", type=float, default=30.0)
    p.add_argument("--callers", type=int, default=6, help="concurrent request loops")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the summary JSON here")
    args = p.parse_args()
    summary = asyncio.run(soak(args))
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    lost = sum(summary["failed"].values()) + summary["mismatched"]
    sys.exit(1 if lost or not summary["all_processes_alive"] else 0)


if __name__ == "__main__":
    main()
