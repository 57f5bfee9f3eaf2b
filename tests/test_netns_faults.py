"""Faults across real network namespaces (issue 46): three hosts on one switch (tests/harness/netns.py), a
3-member etcd cluster (a member per host), the scheduler, four stages in two chains and a router, each a real
`stagemesh` process on its host, mutual TLS with a certificate naming the hosts' addresses. Load runs on h1
(tests/harness/load_client.py). The hosts:

    h1 10.77.0.1  etcd m0, scheduler, router, load
    h2 10.77.0.2  etcd m1, chain A (stages 0:4 and 4:8), chain B's first stage (0:4)
    h3 10.77.0.3  etcd m2, chain B's last stage (4:8)

so that losing h3 leaves chain A whole, and chain B's two stages talk across the switch (stages forward to each
other) while the router reaches both. Each fault is a test of its own on the one mesh, in file order; each starts
by waiting for both chains to serve again."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stagemesh import tls
from stagemesh.launcher import stage_env
from stagemesh.processes import LocalMesh
from tests.harness.etcd_cluster import EtcdCluster
from tests.harness.netns import Host, Hosts, unavailable

pytestmark = pytest.mark.skipif(bool(reason := unavailable()), reason=f"no network namespaces: {reason}")

ROOT = Path(__file__).resolve().parents[1]
ROUTER_PORT = 50051
SCHEDULER_METRICS_PORT = 9100
LOAD_S = 3.0
"""Requests served before a fault and after it heals: the load is steady and the mesh whole."""
LEASE_S = 2.0
"""The stages' registration TTL (RegistrationConfig.ttl_s; etcd rounds a lease up to at least 2 s)."""
STALL_S = 10.0
"""The router's progress timeout (--step-timeout-s, its default floor): a request that took longer waited one out
on a broken chain (an 8-token answer takes well under a second here). A chain's end-to-end probe takes it out, and
its streams off it, within --probe-interval-s plus --probe-failures probe deadlines (1 s and a margin each)."""


def _env() -> dict[str, str]:
    """The stages' environment, with this tree's stagemesh and tests importable in every child."""
    env = stage_env(1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


# The harness itself


def _listen(address: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(16)
    return s


def _connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def _send_s(address: str, port: int, size: int) -> float:
    """Seconds to send `size` bytes and have the peer's kernel take them all (the shutdown's FIN acked)."""
    t0 = time.monotonic()
    with socket.create_connection((address, port), timeout=30) as s:
        s.sendall(b"x" * size)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(30)
        s.recv(1)  # the peer closes after reading all: EOF here
    return time.monotonic() - t0


def _qdiscs(hosts: Hosts) -> str:
    shown = [subprocess.run(["tc", "-n", ns, "qdisc", "show"], capture_output=True, text=True, check=True).stdout
             for ns in [hosts.switch, *(h.netns for h in hosts)]]
    links = subprocess.run(["ip", "-n", hosts.switch, "-br", "link"], capture_output=True, text=True, check=True)
    return "".join(shown) + links.stdout


def test_hosts_reach_each_other_and_each_fault_is_undone_exactly():
    with Hosts(3) as hosts:
        h1, h2, h3 = hosts
        before = _qdiscs(hosts)
        listeners = [h.call(_listen, h.address, 7000) for h in hosts] + [h2.call(_listen, h2.address, 7001)]
        try:
            def reach(a: Host, b: Host, port: int = 7000) -> bool:
                return a.call(_connects, b.address, port)

            def reaches(a: Host, b: Host, port: int = 7000) -> bool:
                """reach, for a path that should work: a link just healed may take a moment (neighbours resolved
                again), so a few tries, bounded."""
                for _ in range(10):
                    if reach(a, b, port):
                        return True
                    time.sleep(0.2)
                return False

            assert reaches(h1, h2) and reaches(h1, h3) and reaches(h2, h3)
            hosts.partition(h1, h2)
            assert not reach(h1, h2) and not reach(h2, h1)
            assert reaches(h1, h3) and reaches(h3, h2)
            hosts.heal()
            assert reaches(h1, h2) and reaches(h2, h1)

            hosts.cut(h2)
            assert not reach(h1, h2) and not reach(h3, h2) and reaches(h1, h3)
            hosts.heal()
            assert reaches(h1, h2)

            hosts.drop(h2, 7000)
            assert not reach(h2, h3) and not reach(h2, h2) and reaches(h2, h2, 7001) and reaches(h1, h2)
            hosts.heal()
            assert reaches(h2, h3) and reaches(h2, h2)

            # The slow path: 64 KiB at 256 kbit/s takes 2 s whatever the machine's pace; unshaped, milliseconds.
            drain = h3.call(_listen, h3.address, 7002)
            listeners.append(drain)
            def reader() -> None:
                for _ in range(2):
                    conn, _ = drain.accept()
                    with conn:
                        while conn.recv(1 << 16):
                            pass

            threading.Thread(target=reader, daemon=True).start()
            hosts.slow(h1, 256, 7002)
            shaped = h1.call(_send_s, h3.address, 7002, 64 * 1024)
            hosts.heal()
            unshaped = h1.call(_send_s, h3.address, 7002, 64 * 1024)
            assert shaped > 1.5 and unshaped < shaped / 3, (shaped, unshaped)
            assert _qdiscs(hosts) == before
        finally:
            for s in listeners:
                s.close()
    assert not any(h.netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for h in hosts)


# The mesh


@dataclass
class Load:
    """A load client on a host: greedy requests back to back, their outcomes read from its JSON lines."""

    host: Host
    out: Path
    popen: subprocess.Popen | None = None
    stop_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.stop_file = self.out.with_suffix(".stop")

    def start(self, router: str, tls_dir: Path) -> Load:
        log = self.out.with_suffix(".log").open("w")
        self.popen = self.host.popen([sys.executable, "-m", "tests.harness.load_client", "--router", router,
                                      "--tls", str(tls_dir), "--out", str(self.out), "--stop", str(self.stop_file)],
                                     cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
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

    def wait(self, condition: Callable[[], bool], within_s: float, what: str) -> None:
        deadline = time.monotonic() + within_s
        while not condition():
            if self.popen is not None and self.popen.poll() is not None:
                pytest.fail(f"the load client exited ({self.popen.returncode}): "
                            f"{self.out.with_suffix('.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {within_s} s")
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
    loads: int = 0
    answer: list[int] | None = None
    """The first greedy answer: every later one, whatever the fault, must be the same."""

    @property
    def router(self) -> str:
        return f"{self.hosts[0].address}:{ROUTER_PORT}"

    def process(self, name: str):
        return next(p for p in self.processes.processes if p.name == name)

    def lapsed(self) -> int:
        """Stages the scheduler keeps in its plan though their registration lapsed (its gauge, read on h1)."""
        def scrape() -> str:
            url = f"http://{self.hosts[0].address}:{SCHEDULER_METRICS_PORT}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()

        found = re.search(r'^stagemesh_scheduler_stages\{state="lapsed"\} (\S+)$', self.hosts[0].call(scrape), re.M)
        return int(float(found.group(1))) if found else 0

    def load(self) -> Load:
        """A fresh load client on h1, once both chains serve and it has had answers."""
        self.loads += 1
        load = Load(self.hosts[0], self.workdir / f"load-{self.loads}.jsonl").start(self.router, self.tls_dir)
        try:
            load.wait(lambda: (c := load.records("chains")) and len(c[-1]["healthy"] or []) == 2, 120,
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


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("netns")
    with Hosts(3) as hosts:
        h1, h2, h3 = hosts
        tls_dir = workdir / "tls"
        subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(tls_dir), "--hosts",
                        ",".join(h.address for h in hosts)], check=True, capture_output=True, env=_env(), timeout=60)
        etcd = EtcdCluster(workdir / "etcd", members=3, tls=tls.load(str(tls_dir)), hosts=list(hosts))
        processes = LocalMesh(str(tiny_model), workdir)
        try:
            etcd.start()
            common = ["--model", str(tiny_model), "--registry", etcd.url, "--tls", str(tls_dir)]
            specs = [(h1, "scheduler", ["scheduler", *common, "--host", h1.address, "--metrics-port",
                                        str(SCHEDULER_METRICS_PORT)]),
                     (h1, "router", ["router", *common, "--host", h1.address, "--port", str(ROUTER_PORT),
                                     "--drain-timeout-s", "1", *os.environ.get("PROBE_ROUTER_ARGS", "").split()])]
            for name, host, layers in (("a0", h2, "0:4"), ("a1", h2, "4:8"), ("b0", h2, "0:4"), ("b1", h3, "4:8")):
                specs.append((host, name, ["stage", *common, "--layers", layers, "--host", host.address, "--port", "0",
                                           "--host-id", host.name, "--threads", "1", "--kv-cache-gb", "0.05",
                                           "--drain-timeout-s", "1"]))
            started = [processes.launch(name, args, _env(), prefix=host.command) for host, name, args in specs]
            processes.processes.extend(started)
            for proc in started:
                processes.wait_ready(proc, 180)
            yield NetnsMesh(hosts, etcd, processes, tls_dir, workdir)
        finally:
            processes.kill()
            etcd.stop()


def test_the_mesh_serves_across_hosts_over_tls(mesh):
    """Two chains as laid out: A within h2, B from h2 to h3; greedy answers all alike."""
    load = mesh.load()
    try:
        chains = load.records("chains")[-1]["healthy"]
        hosts_of = sorted(tuple(s.split(":")[0] for s in c.split(">")) for c in chains)
        assert hosts_of == [("10.77.0.2", "10.77.0.2"), ("10.77.0.2", "10.77.0.3")], chains
    finally:
        load.stop()
    assert not [r["error"] for r in load.records("request") if r["error"]]
    assert len(mesh.answer) == 8 and not mesh.mismatched(load)


@dataclass
class Window:
    """What the load saw from a fault's start to the end of the run: requests (those in flight at its start
    included), failures, the slowest, and the healthy chains the router listed, sample by sample."""

    requests: int
    failures: list[str]
    slowest_s: float
    stalled: int
    """Requests that took over STALL_S."""
    chains: list[int]
    """Healthy chains the router listed, sampled every 0.25 s until the heal."""

    @classmethod
    def of(cls, load: Load, since: float, until: float) -> Window:
        done = load.records("request", since, ended=True)  # those in flight at the fault too
        took = [r["end"] - r["start"] for r in done]
        return cls(len(done), [r["error"] for r in done if r["error"]], max(took, default=0.0),
                   sum(1 for t in took if t > STALL_S),
                   [len(c["healthy"] or []) for c in load.records("chains", since) if c["t"] <= until])

    def flaps(self) -> int:
        """How often the number of healthy chains went back up while the fault held."""
        return sum(1 for a, b in zip(self.chains, self.chains[1:], strict=False) if b > a)


def _under_fault(mesh: NetnsMesh, load: Load, hold_s: float, apply: Callable[[], None],
                 during: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """apply(), load for hold_s (during() once meanwhile), heal, and the load served on after: (start, healed)."""
    t0 = time.time()
    try:
        apply()
        during()
        time.sleep(max(0.0, hold_s - (time.time() - t0)))
    finally:
        mesh.hosts.heal()
    healed = time.time()
    load.wait(lambda: load.served(healed) >= 2, 90, "requests served after the heal")
    return t0, healed


def test_a_scheduler_stopped_10s_under_load_costs_no_request(mesh):
    load = mesh.load()
    pid = mesh.process("scheduler").pid
    t0 = time.time()
    try:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(10)
        served_stopped = load.served(t0)
    finally:
        os.kill(pid, signal.SIGCONT)
        load.stop()
    seen = Window.of(load, t0, t0 + 10)
    print(f"\nscheduler stopped 10 s: {seen}")
    assert served_stopped > 0, "nothing was served while the scheduler was stopped"
    assert not seen.failures, seen
    assert min(seen.chains) == 2, seen.chains
    assert not mesh.mismatched(load)


@pytest.mark.parametrize("path", ["silent", "slow"])
def test_stages_cut_off_from_etcd_past_their_lease_keep_their_chains(mesh, path):
    """Only the stages' path to etcd fails, 4 leases long: h2 and h3 drop what they send to port 2379 (silent), or
    pass it at 2 kbit/s, too slow for their heartbeats (slow). The members still talk to each other on 2380, and
    the scheduler and the router on h1 reach etcd."""
    h1, h2, h3 = mesh.hosts
    load = mesh.load()
    assert mesh.lapsed() == 0
    most_lapsed = 0

    def fault() -> None:
        for host in (h2, h3):
            mesh.hosts.drop(host, 2379) if path == "silent" else mesh.hosts.slow(host, 2, 2379)

    def watch() -> None:
        nonlocal most_lapsed
        deadline = time.monotonic() + 4 * LEASE_S
        while time.monotonic() < deadline:
            most_lapsed = max(most_lapsed, mesh.lapsed())
            time.sleep(0.25)

    try:
        t0, healed = _under_fault(mesh, load, 4 * LEASE_S, fault, during=watch)
    finally:
        load.stop()
    seen = Window.of(load, t0, healed)
    print(f"\nstages' path to etcd {path} {healed - t0:.1f} s: {most_lapsed} registration(s) lapsed at most, {seen}")
    assert most_lapsed > 0, "no stage's registration lapsed: the fault did not bite"
    assert not seen.failures and not mesh.mismatched(load), seen
    assert min(seen.chains) == 2, f"a chain was withdrawn while its stages served: {seen.chains}"


def test_a_host_cut_off_whole_fails_its_chain_over_without_a_failed_request(mesh):
    h1, h2, h3 = mesh.hosts
    load = mesh.load()
    try:
        t0, healed = _under_fault(mesh, load, 8.0, lambda: mesh.hosts.cut(h3), during=lambda: load.wait(
            lambda: len(load.records("chains")[-1]["healthy"] or []) == 1, 30, "chain B withdrawn"))
    finally:
        load.stop()
    seen = Window.of(load, t0, healed)
    print(f"\nh3 cut off {healed - t0:.1f} s: {seen}")
    assert not seen.failures and not mesh.mismatched(load), seen
    assert min(seen.chains) == 1, seen.chains


def test_the_etcd_leaders_host_partitioned_costs_no_request(mesh):
    """The etcd leader moved to h3, then h3 partitioned from h1 and h2: etcd elects another leader, chain B (whose
    last stage is on h3) is withdrawn, chain A serves."""
    h1, h2, h3 = mesh.hosts
    load = mesh.load()

    def partition() -> None:
        mesh.etcd.move_leader(2)
        mesh.hosts.partition(h3, h1)
        mesh.hosts.partition(h3, h2)

    def new_leader() -> None:
        load.wait(lambda: mesh.etcd.leader() in (0, 1), 30, "an etcd leader on h1 or h2")

    try:
        t0, healed = _under_fault(mesh, load, 10.0, partition, during=new_leader)
    finally:
        load.stop()
    seen = Window.of(load, t0, healed)
    print(f"\netcd leader's host partitioned {healed - t0:.1f} s: {seen}")
    assert not seen.failures, seen
    assert not mesh.mismatched(load)


def test_a_partition_between_two_stages_takes_their_chain_out_without_a_failed_or_stalled_request(mesh):
    """h2 and h3 no longer reach each other, the router reaches both: chain B's first stage cannot forward to its
    last. What must hold: the chain is taken out and stays out while the partition lasts, no request fails, and
    none waits out a progress timeout on the broken chain (STALL_S): its probe takes it out first, and its streams
    fail over then. Without probes the chain stays listed and flaps, and each stream sent to it stalls ~11 s."""
    h1, h2, h3 = mesh.hosts
    load = mesh.load()
    try:
        t0, healed = _under_fault(mesh, load, 20.0, lambda: mesh.hosts.partition(h2, h3))
        back = False
        for _ in range(240):  # up to ~60 s
            if back := bool((c := load.records("chains", healed)) and len(c[-1]["healthy"] or []) == 2):
                break
            time.sleep(0.25)
    finally:
        load.stop()
    seen = Window.of(load, t0, healed)
    print(f"\nstage<->stage partition for {healed - t0:.1f} s: {seen}")
    assert not seen.failures, seen
    out = seen.chains.index(1) if 1 in seen.chains else None
    assert out is not None and set(seen.chains[out:]) == {1}, f"chain B not taken out for good: {seen.chains}"
    assert not seen.stalled, f"{seen.stalled} request(s) waited over {STALL_S} s, the slowest {seen.slowest_s:.1f} s"
    if not back:
        # Seen once, when the scheduler withdrew and re-published chain B during the partition (the etcd members
        # on h2 and h3 were cut apart too): its probe passed again after the heal, yet no health check brought it
        # back within 60 s. An open bug, reported here rather than hidden.
        pytest.xfail("chain B not back within 60 s of the heal, though its end-to-end probe passed again")
