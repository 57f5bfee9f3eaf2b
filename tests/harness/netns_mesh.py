"""The namespace mesh: three hosts on one switch (tests/harness/netns.py), a 3-member etcd cluster (a member per
host), the scheduler, four stages in two chains and a router, each a real `stagemesh` process on its host, mutual
TLS with a certificate naming the hosts' addresses; and a load client on h1 (tests/harness/load_client.py), whose
JSON lines say what each request got. What tests/test_netns_faults.py and `scripts/soak.py --netns` run on.

    h1 10.77.0.1  etcd m0, scheduler, router, load
    h2 10.77.0.2  etcd m1, chain A (stages a0 0:4 and a1 4:8), chain B's first stage (b0 0:4)
    h3 10.77.0.3  etcd m2, chain B's last stage (b1 4:8)

so that losing h3 leaves chain A whole, and chain B's two stages talk across the switch (stages forward to each
other) while the router reaches both. Needs root (netns.unavailable() says why not)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh import tls
from stagemesh.launcher import stage_env
from stagemesh.processes import LocalMesh, Process
from tests.harness.etcd_cluster import EtcdCluster
from tests.harness.netns import Host, Hosts

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PORT = 50051
SCHEDULER_METRICS_PORT = 9100
LOAD_S = 3.0
"""Requests served before a fault and after it heals: the load is steady and the mesh whole."""
STAGES = (("a0", 1, "0:4"), ("a1", 1, "4:8"), ("b0", 1, "0:4"), ("b1", 2, "4:8"))
"""Each stage's name, the index of its host and its layers."""


def harness_env() -> dict[str, str]:
    """The stages' environment, with this tree's stagemesh and tests importable in every child."""
    env = stage_env(1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class Load:
    """A load client on a host: greedy requests back to back, their outcomes read from its JSON lines."""

    host: Host
    out: Path
    popen: subprocess.Popen | None = None
    stop_file: Path = field(init=False)
    _read: int = field(default=0, init=False)
    """Bytes of `out` that new_records() has returned."""

    def __post_init__(self) -> None:
        self.stop_file = self.out.with_suffix(".stop")

    def start(self, router: str, tls_dir: Path, extra: Sequence[str] = ()) -> Load:
        """extra: more load_client flags (--prompts, --streams, --max-s...)."""
        log = self.out.with_suffix(".log").open("w")
        self.popen = self.host.popen([sys.executable, "-m", "tests.harness.load_client", "--router", router,
                                      "--tls", str(tls_dir), "--out", str(self.out), "--stop", str(self.stop_file),
                                      *extra], cwd=ROOT, env=harness_env(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def records(self, kind: str, since: float = 0.0, ended: bool = False) -> list[dict]:
        """Records of a kind from `since` on: requests started then (ended: those that ended then, which counts
        the ones in flight at `since` too) and samples taken then."""
        if not self.out.exists():
            return []
        lines = [json.loads(line) for line in self.out.read_text().splitlines() if line.endswith("}")]
        return [r for r in lines if r["kind"] == kind
                and r.get("end" if ended else "start", r.get("t", 0)) >= since]

    def new_records(self) -> list[dict]:
        """The whole lines written since the last call: a reader of hours of load need not parse it all again."""
        if not self.out.exists():
            return []
        with self.out.open("rb") as f:
            f.seek(self._read)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        self._read += len(whole)
        return [json.loads(line) for line in whole.splitlines()]

    def wait(self, condition: Callable[[], bool], within_s: float, what: str) -> None:
        """Until condition() holds; TimeoutError after within_s, RuntimeError if the client exits first."""
        deadline = time.monotonic() + within_s
        while not condition():
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"the load client exited ({self.popen.returncode}): "
                                   f"{self.out.with_suffix('.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {within_s} s")
            time.sleep(0.2)

    def served(self, since: float) -> int:
        return sum(1 for r in self.records("request", since) if not r["error"])

    def stop(self) -> None:
        self.stop_file.touch()
        if self.popen is not None:
            try:
                self.popen.wait(60)  # a request in flight finishes within its 30 s deadline
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class NetnsMesh:
    hosts: Hosts
    etcd: EtcdCluster
    processes: LocalMesh
    tls_dir: Path
    workdir: Path
    host_of: dict[str, Host]
    """Each process's host, by name (a restart starts it there again)."""
    loads: int = 0
    answer: list[int] | None = None
    """The first greedy answer of the load's fixed prompt: every later one, whatever the fault, must be the same."""

    @property
    def router(self) -> str:
        return f"{self.hosts[0].address}:{ROUTER_PORT}"

    def process(self, name: str) -> Process:
        return next(p for p in self.processes.processes if p.name == name)

    def pids(self) -> dict[str, int | None]:
        """Every process of the mesh by name: the stagemesh ones and the etcd members (m0..m2; None while down)."""
        pids: dict[str, int | None] = {p.name: p.pid for p in self.processes.processes}
        pids.update({name: p and p.pid for name, p in zip(self.etcd.names, self.etcd.procs, strict=True)})
        return pids

    def alive(self) -> dict[str, bool]:
        alive = {p.name: p.running() for p in self.processes.processes}
        alive.update({name: p is not None and p.poll() is None
                      for name, p in zip(self.etcd.names, self.etcd.procs, strict=True)})
        return alive

    def restart(self, name: str, timeout_s: float = 180.0) -> Process:
        """A process that exited started again on its host with its flags (a stage on port 0: a new port, which
        the scheduler learns from its registration), and ready."""
        old = self.process(name)
        new = self.processes.launch(name, old.args, harness_env(), append_log=True, prefix=self.host_of[name].command)
        self.processes.replace(old, new)
        return self.processes.wait_ready(new, timeout_s)

    def restart_etcd(self, down_s: float, timeout_s: float = 60.0) -> None:
        """Every etcd member killed (SIGKILL), down for down_s, then started again on its data: the whole registry
        gone and back, as a restart of its machines would make it."""
        for i in range(len(self.etcd.names)):
            self.etcd.kill(i)
        time.sleep(down_s)
        for i in range(len(self.etcd.names)):
            self.etcd.start_member(i, wait=False)  # none is healthy before a quorum runs
        self.etcd.wait_healthy(range(len(self.etcd.names)), timeout_s)

    def lapsed(self) -> int:
        """Stages the scheduler keeps in its plan though their registration lapsed (its gauge, read on h1)."""
        def scrape() -> str:
            url = f"http://{self.hosts[0].address}:{SCHEDULER_METRICS_PORT}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()

        found = re.search(r'^stagemesh_scheduler_stages\{state="lapsed"\} (\S+)$', self.hosts[0].call(scrape), re.M)
        return int(float(found.group(1))) if found else 0

    def load(self, extra: Sequence[str] = (), ready_s: float = 120.0) -> Load:
        """A fresh load client on h1 (extra: its flags), once both chains serve and it has had answers."""
        self.loads += 1
        load = Load(self.hosts[0], self.workdir / f"load-{self.loads}.jsonl").start(self.router, self.tls_dir, extra)
        try:
            load.wait(lambda: (c := load.records("chains")) and len(c[-1]["healthy"] or []) == 2, ready_s,
                      "both chains serving")
            t0 = time.time()
            load.wait(lambda: load.served(0) >= 2 and time.time() - t0 >= LOAD_S, 60, "the load served")
        except BaseException:
            load.stop()
            raise
        if self.answer is None:
            self.answer = next(r["tokens"] for r in load.records("request") if not r["error"])
        return load

    def mismatched(self, load: Load) -> list[list[int]]:
        """The answers this load got that differ from the mesh's first."""
        return [r["tokens"] for r in load.records("request") if not r["error"] and r["tokens"] != self.answer]


@contextlib.contextmanager
def netns_mesh(model: Path | str, workdir: Path, router_args: Sequence[str] = ()) -> Iterator[NetnsMesh]:
    """The mesh started and ready (each process's log in workdir); every process and namespace gone after."""
    with Hosts(3) as hosts:
        h1 = hosts[0]
        tls_dir = workdir / "tls"
        subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(tls_dir), "--hosts",
                        ",".join(h.address for h in hosts)], check=True, capture_output=True, env=harness_env(),
                       timeout=60)
        etcd = EtcdCluster(workdir / "etcd", members=3, tls=tls.load(str(tls_dir)), hosts=list(hosts))
        processes = LocalMesh(str(model), workdir)
        try:
            etcd.start()
            common = ["--model", str(model), "--registry", etcd.url, "--tls", str(tls_dir)]
            specs = [(h1, "scheduler", ["scheduler", *common, "--host", h1.address, "--metrics-port",
                                        str(SCHEDULER_METRICS_PORT)]),
                     (h1, "router", ["router", *common, "--host", h1.address, "--port", str(ROUTER_PORT),
                                     "--drain-timeout-s", "1", *router_args])]
            for name, host, layers in ((name, hosts[i], layers) for name, i, layers in STAGES):
                specs.append((host, name, ["stage", *common, "--layers", layers, "--host", host.address, "--port", "0",
                                           "--host-id", host.name, "--threads", "1", "--kv-cache-gb", "0.05",
                                           "--drain-timeout-s", "1"]))
            started = [processes.launch(name, args, harness_env(), prefix=host.command) for host, name, args in specs]
            processes.processes.extend(started)
            for proc in started:
                processes.wait_ready(proc, 180)
            yield NetnsMesh(hosts, etcd, processes, tls_dir, workdir, {name: host for host, name, _ in specs})
        finally:
            processes.kill()
            etcd.stop()
