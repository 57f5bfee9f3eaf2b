"""Soak: N minutes of mixed traffic through a 2x2 mesh of real processes, with one fault injected
every minute (SIGKILL, SIGSTOP, a cut, a black hole, a 200 ms delay, garbage bytes, in turn, each held
for a while and then healed). Every greedy answer is checked against transformers' greedy generate().

With --netns (root), the mesh is the namespace mesh of tests/harness/netns_mesh.py instead: three hosts,
a 3-member etcd, the scheduler, two chains (B across two hosts), a router, mutual TLS, greedy load from
a client on h1; the faults, in turn, are the control plane's (the scheduler stopped, the whole etcd
cluster killed and restarted on its data, chain B's two stages partitioned from each other) and a
stage's (SIGKILL and a restart, SIGSTOP). After each heal it waits (bounded) for both chains to serve
again, and counts the faults after which they did not (chains_not_back) without stopping.

Prints, every `--report-s` seconds: RSS per process, completed and failed streams, mismatches (and
open sessions and KV bytes per stage on the static mesh). Ends with a JSON summary (also written to
--out) and exits non-zero if any stream was lost (failed or wrong).

    python scripts/soak.py --minutes 30                 # the docs' soak run (docs/performance.md)
    python scripts/soak.py --minutes 2 --fault-every-s 20   # a quick look
    sudo .venv/bin/python scripts/soak.py --netns --minutes 120   # the control-plane soak (issue 46)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import grpc  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from scripts.bench import stop_on_sigterm  # noqa: E402
from stagemesh import grpc_server  # noqa: E402
from stagemesh.tiny_model import make_tiny_model  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tests.harness.fault_mesh import FAULTS, FaultMesh  # noqa: E402
from tests.harness.netns import unavailable  # noqa: E402
from tests.harness.netns_mesh import STAGES, Load, NetnsMesh, netns_mesh  # noqa: E402

FAULT_HELD_S = 8.0
NETNS_FAULTS = ("scheduler_stall", "registry_restart", "partition", "stage_sigkill", "stage_sigstop")
BACK_S = 60.0
"""How long after a heal both chains may take to serve again before the fault counts in chains_not_back."""


def reference(model_dir: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            out.append(gen[0, len(p):].tolist())
    return out


def workload(args: argparse.Namespace) -> tuple[str, list[list[int]], list[list[int]]]:
    """The checkpoint (--model, or a tiny random Llama made now), 16 seeded prompts and their greedy answers."""
    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp(prefix="soak-")) / "tiny-llama", "llama"))
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(4, 1000, (int(rng.uniform(4, 120)),), generator=gen).tolist() for _ in range(16)]
    return model, prompts, reference(model, prompts, args.new_tokens)


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


def rss_mib(pids: dict[str, int | None]) -> dict[str, float | None]:
    """Each process's resident memory; None for one that is down (no pid, or gone)."""
    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            out[name] = None if pid is None else round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = None
    return out


async def soak(args) -> dict:
    model, prompts, expected = workload(args)
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


class NetnsSoak:
    """The soak on the namespace mesh: reads the load client's records as they come (the soak's own process, in
    the root namespace, cannot reach the hosts), tallies them against the references, and reports."""

    def __init__(self, mesh: NetnsMesh, load: Load, expected: list[list[int]], report_s: float):
        self.mesh, self.load, self.expected, self.report_s = mesh, load, expected, report_s
        self.tally, self.samples = Tally(), []
        self.chains_at: tuple[float, int] = (0.0, 0)
        """(time.time(), healthy chains) of the router's latest listing seen by the load."""
        self.fewest_chains = 2
        """The fewest healthy chains listed since the soak set it back to 2 (at each fault)."""
        self.slowest_s = 0.0
        self.t0 = time.monotonic()
        self.next_report = self.t0

    def tick(self) -> None:
        """Takes in the load's new records."""
        for r in self.load.new_records():
            if r["kind"] == "chains":
                self.chains_at = (r["t"], len(r["healthy"] or []))
                self.fewest_chains = min(self.fewest_chains, self.chains_at[1])
                continue
            self.slowest_s = max(self.slowest_s, r["end"] - r["start"])
            if r["error"]:
                self.tally.failed[r["error"].split(":")[0]] += 1
            else:
                self.tally.completed += 1
                self.tally.mismatched += r["tokens"] != self.expected[r["prompt"]]

    def poll(self) -> None:
        """tick(), and a report when one is due."""
        self.tick()
        if time.monotonic() >= self.next_report:
            self.report()
            self.next_report += self.report_s

    def report(self) -> dict:
        pids = {**self.mesh.pids(), "load": self.load.popen.pid}
        sample = {"t_s": round(time.monotonic() - self.t0), "rss_mib": rss_mib(pids),
                  "healthy_chains": self.chains_at[1], "completed": self.tally.completed,
                  "failed": dict(self.tally.failed), "mismatched": self.tally.mismatched,
                  "slowest_s": round(self.slowest_s, 1)}
        self.samples.append(sample)
        print(json.dumps(sample), flush=True)
        return sample

    def sleep(self, seconds: float) -> None:
        """time.sleep that keeps the tally and the reports going."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.poll()
            time.sleep(min(0.25, left))

    def chains_back(self, since: float, within_s: float) -> float | None:
        """Seconds until the router listed both chains healthy after `since` (time.time()); None if not within_s."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.poll()
            t, healthy = self.chains_at
            if t >= since and healthy == 2:
                return round(t - since, 1)
            time.sleep(0.25)
        return None

    def faults(self, seconds: float, every_s: float, hold_s: float) -> list[dict]:
        """A fault every every_s for `seconds`, NETNS_FAULTS in turn (a stage's on a0, a1, b0, b1 in turn), each
        followed by a wait of up to BACK_S for both chains to serve; what each did."""
        done: list[dict] = []
        stop_at = self.t0 + seconds
        next_fault = self.t0 + every_s
        while time.monotonic() < stop_at:
            if time.monotonic() < next_fault:
                self.sleep(min(next_fault, stop_at) - time.monotonic())
                continue
            n, at = len(done), time.monotonic()
            fault, stage = NETNS_FAULTS[n % len(NETNS_FAULTS)], STAGES[(n // len(NETNS_FAULTS)) % len(STAGES)][0]
            self.fewest_chains = 2
            target = self.fault(fault, stage, hold_s)
            back = self.chains_back(time.time(), BACK_S)
            done.append({"at_s": round(at - self.t0), "fault": fault, "target": target,
                         "fewest_chains": self.fewest_chains, "back_s": back})
            print(json.dumps({"fault": done[-1]}), flush=True)
            if back is None:
                print(f"both chains not back within {BACK_S:.0f} s of the heal of {fault}", flush=True)
            next_fault = max(next_fault + every_s, time.monotonic() + 1)
        self.tick()
        return done

    def fault(self, fault: str, stage: str, hold_s: float) -> str:
        """Injects one fault, holds it (the load going on), heals it; returns what it hit."""
        h1, h2, h3 = self.mesh.hosts
        if fault == "scheduler_stall":
            pid = self.mesh.process("scheduler").pid
            os.kill(pid, signal.SIGSTOP)
            try:
                self.sleep(hold_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            return "scheduler"
        if fault == "registry_restart":
            etcd = self.mesh.etcd
            for i in range(len(etcd.names)):
                etcd.kill(i)
            try:
                self.sleep(hold_s)
            finally:
                for i in range(len(etcd.names)):
                    etcd.start_member(i, wait=False)  # none is healthy before a quorum runs
            etcd.wait_healthy(range(len(etcd.names)), 60)
            return "etcd m0-m2"
        if fault == "partition":  # chain B's stages, b0 on h2 and b1 on h3; the router on h1 reaches both
            self.mesh.hosts.partition(h2, h3)
            try:
                self.sleep(2 * hold_s)  # long enough for the probe to take chain B out and keep it out a while
            finally:
                self.mesh.hosts.heal()
            return "h2<->h3"
        proc = self.mesh.process(stage)
        if fault == "stage_sigkill":
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(10)
            self.sleep(hold_s)
            self.mesh.restart(stage)
        elif fault == "stage_sigstop":
            proc.popen.send_signal(signal.SIGSTOP)
            try:
                self.sleep(hold_s)
            finally:
                proc.popen.send_signal(signal.SIGCONT)
        else:
            raise ValueError(f"fault {fault!r}: use one of {NETNS_FAULTS}")
        return stage


def soak_netns(args: argparse.Namespace) -> dict:
    model, prompts, expected = workload(args)
    workdir = Path(tempfile.mkdtemp(prefix="soak-netns-"))
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    with netns_mesh(model, workdir) as mesh:
        load = mesh.load(["--prompts", str(workdir / "prompts.json"), "--streams", str(args.callers),
                          "--max-new-tokens", str(args.new_tokens), "--timeout-s", "60", "--seed", str(args.seed),
                          "--max-s", str(args.minutes * 60 + 600)])
        run = NetnsSoak(mesh, load, expected, args.report_s)
        try:
            faults = run.faults(args.minutes * 60, args.fault_every_s, args.hold_s)
            last = run.report()  # the load client's RSS too, before it stops
        finally:
            load.stop()
        run.tick()  # the requests that were in flight
        alive = mesh.alive()
    return {
        "mode": "netns", "minutes": args.minutes, "callers": args.callers, "faults": faults,
        "completed": run.tally.completed, "failed": dict(run.tally.failed), "mismatched": run.tally.mismatched,
        "chains_not_back": sum(f["back_s"] is None for f in faults), "back_within_s": BACK_S,
        "slowest_s": round(run.slowest_s, 1), "all_processes_alive": all(alive.values()),
        "rss_mib_start": run.samples[0]["rss_mib"], "rss_mib_end": last["rss_mib"], "logs": str(workdir),
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
    p.add_argument("--netns", action="store_true",
                   help="the namespace mesh with control-plane faults (needs root and `ip netns`)")
    p.add_argument("--hold-s", type=float, default=10.0,
                   help="--netns: how long each fault is held (a partition twice as long)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # the namespaces, etcd and every process go with it
    if args.netns and (why := unavailable()):
        sys.exit(f"soak.py --netns needs network namespaces, and cannot make them here: {why}")
    summary = soak_netns(args) if args.netns else asyncio.run(soak(args))
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    lost = sum(summary["failed"].values()) + summary["mismatched"]
    sys.exit(1 if lost or not summary["all_processes_alive"] else 0)


if __name__ == "__main__":
    main()
