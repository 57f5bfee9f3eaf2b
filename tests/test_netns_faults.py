"""Faults across real network namespaces (issue 46), on the namespace mesh of tests/harness/netns_mesh.py: three
hosts on one switch, a 3-member etcd cluster, the scheduler, two chains (A within h2, B from h2 to h3) and a router,
each a real `stagemesh` process over mutual TLS, and greedy load from a client on h1. Each fault is a test of its
own on the one mesh, in file order; each starts by waiting for both chains to serve again."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.harness.netns import Host, Hosts, unavailable
from tests.harness.netns_mesh import ROOT, STAGES, Load, NetnsMesh, netns_mesh

pytestmark = pytest.mark.skipif(bool(reason := unavailable()), reason=f"no network namespaces: {reason}")

LEASE_S = 2.0
"""The stages' registration TTL (RegistrationConfig.ttl_s; etcd rounds a lease up to at least 2 s)."""
STALL_S = 10.0
"""The router's progress timeout (--step-timeout-s, its default floor): a request that took longer waited one out
on a broken chain (an 8-token answer takes well under a second here). A chain's end-to-end probe takes it out, and
its streams off it, within --probe-interval-s plus --probe-failures probe deadlines (1 s and a margin each)."""


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


# The soak


@pytest.mark.timeout(300)
def test_the_soak_on_the_namespace_mesh_meets_each_control_plane_fault(tiny_model, tmp_path):
    """scripts/soak.py --netns, 36 s short, its faults every 10 s and held 3 s: the scheduler stopped, the
    etcd cluster restarted, chain B's stages partitioned, each once; every stream completed and equal to
    transformers'; RSS of every process reported. Whether chain B came back after the partition is the soak's
    chains_not_back, left to its long runs (test_a_partition_between_two_stages_... below has it)."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--netns", "--model", str(tiny_model),
                           "--minutes", "0.6", "--fault-every-s", "10", "--hold-s", "3", "--report-s", "10",
                           "--callers", "2", "--new-tokens", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    summary = json.loads(out.read_text())
    print(f"\nsoak --netns: {summary['faults']}")
    assert [f["fault"] for f in summary["faults"]][:3] == ["scheduler_stall", "registry_restart", "partition"]
    assert summary["completed"] > 0 and not summary["failed"] and not summary["mismatched"], summary
    named = {"scheduler", "router", "m0", "m1", "m2", "load", *(name for name, _, _ in STAGES)}
    assert set(summary["rss_mib_start"]) == named and all(summary["rss_mib_start"].values())
    assert summary["all_processes_alive"]


# The mesh


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    with netns_mesh(tiny_model, tmp_path_factory.mktemp("netns"),
                    router_args=os.environ.get("PROBE_ROUTER_ARGS", "").split()) as started:
        yield started


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
    # It was not, twice: the scheduler withdrew chain B while the router's check of it waited, the withdrawal closed
    # its channels and so cancelled the check, and the cancellation ended the router's health loop for good.
    assert back, "chain B not back within 60 s of the heal"
