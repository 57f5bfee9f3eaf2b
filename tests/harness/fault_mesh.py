"""A mesh of real processes with a switchable link in front of every stage: what the fault tests and
`scripts/soak.py` inject faults into. Two (or more) chains of stages with fixed layer ranges on fixed
ports (so a killed stage can be restarted where the router expects it), a LinkProxy in front of each,
and a router over the proxies."""

from __future__ import annotations

import signal
import socket
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from stagemesh.launcher import LocalMesh, even_split, stage_env
from stagemesh.v1 import router_pb2, stage_pb2, stage_pb2_grpc
from tests.harness.link_proxy import LinkProxy

FAULTS = ("sigkill", "sigstop", "cut", "black_hole", "delay", "garbage")
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: each socket is held until all are bound (a port closed and taken
    again at once can come back from the next bind: 6 ports asked one at a time repeated one in ~1,000 here,
    and an etcd cluster of 3 got two members on one peer port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


class FaultMesh:
    """`chains` chains of `stages` stages as processes, each stage behind a LinkProxy; a router."""

    def __init__(self, model: str, log_dir: Path, *, chains: int = 2, stages: int = 2, num_layers: int,
                 stage_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (), ready_timeout_s: float = 600.0):
        """ready_timeout_s: how long the processes, started at once, may take to be ready. Generous: it is
        waited out only by a mesh that fails to start, and 7 processes sharing 2 cores with another test
        file's took over 120 s once."""
        self.model = str(model)
        self.mesh = LocalMesh(self.model, Path(log_dir))
        self.layers = even_split(num_layers, stages) * chains
        self.per_chain = stages
        self.stage_args = list(stage_args)
        self.ports = free_ports(len(self.layers))
        self.router_metrics_port = free_port()
        self.links: list[LinkProxy] = []
        try:
            # The proxies listen first and the router starts with the stages: it health-checks its chains until
            # their stages serve, so the mesh is up in about the time of its slowest process.
            self.links = [LinkProxy(f"127.0.0.1:{port}").start() for port in self.ports]
            specs = [",".join(link.address for link in self.links[c:c + stages])
                     for c in range(0, len(self.links), stages)]
            *self.stages, self.router = self.mesh.spawn_together(
                [*(self._stage_spec(i) for i in range(len(self.layers))),
                 ("router", ["router", "--model", self.model, "--port", "0",
                             "--metrics-port", str(self.router_metrics_port), *router_args,
                             *[a for spec in specs for a in ("--chain", spec)]])], stage_env(1),
                timeout=ready_timeout_s)
            self.wait_serving(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_serving(self, timeout_s: float) -> None:
        """Until the router's health says SERVING (a whole chain passed its checks), as a load balancer in front
        of it waits: a router is ready before its first checks of the stages end, and a request sent in that
        moment is refused (no usable chain), which is no fault of the mesh's."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.router.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=ROUTER_SERVICE), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router at {self.router.address} was not SERVING in {timeout_s:.0f}s")
                time.sleep(0.1)

    def _stage_spec(self, i: int) -> tuple[str, list[str]]:
        a, b = self.layers[i]
        return f"stage{i}", ["stage", "--model", self.model, "--layers", f"{a}:{b}", "--port", str(self.ports[i]),
                             "--threads", "1", *self.stage_args]

    def restart_stage(self, i: int) -> None:
        """A stage that was killed comes back on its port (the router finds it again by health checks)."""
        self.stages[i] = self.mesh.spawn(*self._stage_spec(i), stage_env(1))

    def alive(self) -> list[bool]:
        return [p.popen.poll() is None for p in (*self.stages, self.router)]

    def open_sessions(self) -> list[tuple[int, int]]:
        """(open sessions, KV bytes in use) of every stage, in order."""
        out = []
        for port in self.ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=5)
            out.append((info.open_sessions, info.kv_used_bytes))
        return out

    def router_counter(self, name: str) -> float:
        """A counter of the router's /metrics (its total over every label; 0 before it is first counted)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.router_metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == f"{name}_total")

    def busy_stage(self, index_in_chain: int) -> int:
        """The stage at this position of the chain that holds the most sessions now."""
        sessions = [n for n, _ in self.open_sessions()]
        chain = max(range(len(self.layers) // self.per_chain), key=lambda c: sessions[c * self.per_chain])
        return chain * self.per_chain + index_in_chain

    def inject(self, fault: str, stage: int) -> None:
        """Starts a fault on one stage (or its link); heal() ends it."""
        proc, link = self.stages[stage], self.links[stage]
        if fault == "sigkill":
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(10)
        elif fault == "sigstop":
            proc.popen.send_signal(signal.SIGSTOP)
        elif fault == "cut":
            link.set(cut=True)
        elif fault == "black_hole":
            link.set(black_hole=True)
        elif fault == "delay":
            link.set(delay_s=0.2)
        elif fault == "garbage":
            self.send_garbage()
        else:
            raise ValueError(f"fault {fault!r}: use one of {FAULTS}")

    def heal(self, fault: str, stage: int) -> None:
        if fault == "sigkill":
            self.restart_stage(stage)
        elif fault == "sigstop":
            self.stages[stage].popen.send_signal(signal.SIGCONT)
        elif fault in ("cut", "black_hole", "delay"):
            self.links[stage].set()

    def send_garbage(self) -> None:
        """HTTP/2's preface followed by noise, to every port of the mesh."""
        addresses = [self.router.address, *(link.address for link in self.links),
                     *(f"127.0.0.1:{p}" for p in self.ports)]
        for address in addresses:
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=2) as sock:
                    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(range(256)) * 4)
            except OSError:
                pass

    def stop(self) -> None:
        for link in self.links:
            link.stop()
        for proc in getattr(self, "stages", []):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.mesh.stop()
