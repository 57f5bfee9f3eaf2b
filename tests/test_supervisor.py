"""`stagemesh up` as a supervisor, as a real process with its real children: a stage killed with SIGKILL is
restarted and the mesh recovers while requests keep succeeding; `stagemesh roll` replaces every stage one
by one under steady traffic without a failed request; SIGHUP reaches every child and ends none; SIGTERM stops the
mesh in order, router first."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from stagemesh.launcher import stage_env
from stagemesh.rolling import roll_stages, usable_chains
from stagemesh.supervisor import read_state
from stagemesh.v1 import router_pb2, router_pb2_grpc
from tests.conftest import hf_greedy

ROOT = Path(__file__).resolve().parent.parent
DRAIN_S = 20.0
TOKENS = 16
CHAINS = 2
START_S = 180.0
"""Bounds on waits: generous, so that they hold on a machine many times slower than this one."""
RECOVER_S = 120.0


@dataclass
class Up:
    popen: subprocess.Popen
    log_dir: Path

    def state(self) -> dict:
        return read_state(self.log_dir)

    def pids(self, role: str | None = None) -> dict[str, int]:
        return {p["name"]: p["pid"] for p in self.state()["processes"] if role in (None, p["role"])}


def wait_until(check, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s"
        time.sleep(interval)
    return value


@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up")
    with (log_dir / "up.out").open("w") as out, (log_dir / "up.err").open("w") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "stagemesh.cli", "up", "--model", str(tiny_model), "--stages", "2",
             "--replicas", str(CHAINS), "--port", "0", "--threads", "1", "--drain-timeout-s", str(DRAIN_S),
             "--log-dir", str(log_dir)], stdout=out, stderr=err, cwd=ROOT, env=stage_env(1))
    mesh = Up(popen, log_dir)
    try:
        def serving():
            assert popen.poll() is None, (log_dir / "up.err").read_text()[-3000:]
            if not (log_dir / "mesh.json").exists():
                return False
            return len(usable_chains(mesh.state()["router"]) or []) == CHAINS
        wait_until(serving, START_S, f"stagemesh up did not serve {CHAINS} chains")
        yield mesh
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=3 * DRAIN_S + 60)
            except subprocess.TimeoutExpired:
                popen.kill()  # its children get SIGTERM from the kernel (PR_SET_PDEATHSIG)
                popen.wait()


@pytest.fixture(scope="module")
def cases(hf_models):
    prompts = [[3 + i, 14, 15, 92 + i, 65] for i in range(8)]
    return [(p, hf_greedy(hf_models["llama"], p, TOKENS)) for p in prompts]


class Callers:
    """A few callers, each sending greedy requests one after another (a bounded loop) and checking every
    answer against transformers."""

    def __init__(self, router: str, cases: list, callers: int = 3, max_requests: int = 5000, pause_s: float = 0.1):
        self.router, self.cases, self.max_requests, self.pause_s = router, cases, max_requests, pause_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(k, callers), daemon=True) for k in range(callers)]

    def __enter__(self) -> Callers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a caller is stuck"

    def _loop(self, k: int, step: int) -> None:
        with grpc.insecure_channel(self.router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            i = k
            while not self.stop.is_set() and self.ok + len(self.failures) < self.max_requests:
                prompt, want = self.cases[i % len(self.cases)]
                i += step
                request = router_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=TOKENS, temperature=0.0,
                                                     request_id=f"caller{k}-{i}")
                try:
                    got = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
                    problem = None if got == want else f"{request.request_id}: {got} != {want}"
                except grpc.RpcError as exc:
                    problem = f"{request.request_id}: {exc.code().name} {exc.details()}"
                with self.lock:
                    if problem:
                        self.failures.append(problem)
                    else:
                        self.ok += 1
                self.stop.wait(self.pause_s)  # steady, and light enough to leave the restarts some CPU


def test_a_killed_stage_is_restarted_and_the_mesh_recovers_while_requests_succeed(up, cases):
    state = up.state()
    router, before = state["router"], up.pids()
    chains = usable_chains(router)
    victim_address = chains[0].stages[-1].address
    victim = next(p for p in state["processes"] if p["address"] == victim_address)

    def recovered():
        now = next(p for p in up.state()["processes"] if p["name"] == victim["name"])
        usable = usable_chains(router) or []
        return (now["pid"] != victim["pid"] and now["ready"] and len(usable) == CHAINS
                and all(s.address != victim_address for c in usable for s in c.stages))

    with Callers(router, cases) as callers:
        wait_until(lambda: callers.ok >= 3, 60, "requests did not succeed before the kill")
        psutil.Process(victim["pid"]).kill()  # SIGKILL: no drain, no goodbye to the registry
        t0, ok_at_kill = time.monotonic(), callers.ok
        wait_until(recovered, RECOVER_S, f"{victim['name']} was not restarted into a whole chain again")
        took = time.monotonic() - t0
        wait_until(lambda: callers.ok >= ok_at_kill + 3, 60, "requests did not go on after the kill")
    print(f"recovered in {took:.1f}s; {callers.ok} requests, all exact")
    assert callers.failures == []
    after = up.pids()
    assert after[victim["name"]] != victim["pid"]
    assert {n: p for n, p in after.items() if n != victim["name"]} == {
        n: p for n, p in before.items() if n != victim["name"]}, "only the killed stage was restarted"
    exits = up.state()["exits"]
    assert {"name": victim["name"], "pid": victim["pid"], "returncode": -signal.SIGKILL} in [
        {k: e[k] for k in ("name", "pid", "returncode")} for e in exits]


def test_rolling_update_replaces_every_stage_without_a_failed_request(up, cases):
    router = up.state()["router"]
    stages, others = up.pids("stage"), {**up.pids("router"), **up.pids("scheduler")}
    assert len(stages) == 2 * CHAINS
    t0 = time.monotonic()
    with Callers(router, cases) as callers:
        wait_until(lambda: callers.ok >= 3, 60, "requests did not succeed before the roll")
        rolled = roll_stages(up.log_dir, timeout_s=RECOVER_S)
        wait_until(lambda: len(usable_chains(router) or []) == CHAINS, RECOVER_S, "chains back after the roll")
    took = time.monotonic() - t0
    print(f"rolled {len(rolled)} stages in {took:.1f}s under {callers.ok} requests: "
          + ", ".join(f"{r.name} {r.seconds:.1f}s" for r in rolled))
    assert callers.failures == []
    assert callers.ok >= 10
    assert [r.name for r in rolled] == list(stages)
    assert [r.old_pid for r in rolled] == list(stages.values())
    now = up.pids("stage")
    assert now == {r.name: r.new_pid for r in rolled} and not set(now.values()) & set(stages.values()), \
        "every stage process was replaced"
    assert {**up.pids("router"), **up.pids("scheduler")} == others, "the router and the scheduler stayed"
    # Each old stage drained and exited by itself (code 0), none was killed, and none logged an error.
    codes = {e["pid"]: e["returncode"] for e in up.state()["exits"]}
    assert [codes[pid] for pid in stages.values()] == [0] * len(stages)
    for name in stages:
        log = (up.log_dir / f"{name}.log").read_text()
        assert log.count("drained in") >= 1
        assert not [line for line in log.splitlines() if '"level": "error"' in line or "Traceback" in line], name


def _events(path: Path, text: str) -> list[str]:
    """Timestamps of the log lines (JSON) whose message starts with text."""
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [e["ts"] for e in entries if e["msg"].startswith(text)]


def test_sighup_is_passed_on_to_every_process_and_ends_none(up):
    """`systemctl reload` of `stagemesh up`: each child reads its files again (here, with no --tls, each stage and
    the scheduler logs that it has nothing to reload), and every process, `up` included, goes on."""
    before = up.pids()
    logs = {p["name"]: Path(p["log"]) for p in up.state()["processes"] if p["role"] in ("stage", "scheduler")}
    up.popen.send_signal(signal.SIGHUP)

    def every_child_logged() -> bool:
        assert up.popen.poll() is None, "SIGHUP ended stagemesh up"
        return all(_events(path, "SIGHUP: nothing to reload") for path in logs.values())

    wait_until(every_child_logged, RECOVER_S, "every stage and the scheduler logged the SIGHUP")
    assert up.popen.poll() is None and up.pids() == before
    assert all(psutil.pid_exists(pid) for pid in before.values())


def test_sigterm_stops_the_mesh_router_first_then_stages_then_scheduler(up):
    state = up.state()
    children = [p["pid"] for p in state["processes"]]
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(timeout=3 * DRAIN_S + 60) == 0
    assert not [pid for pid in children if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "a child outlived stagemesh up"
    assert up.state()["stopped"] is True
    logs = {p["name"]: Path(p["log"]) for p in state["processes"]}
    router_done = _events(logs["router"], "drained")[-1]
    stages_stopping = [_events(logs[n], "stopping")[-1] for n in logs if n.startswith("stage")]
    stages_done = [_events(logs[n], "drained")[-1] for n in logs if n.startswith("stage")]
    scheduler_stopping = _events(logs["scheduler"], "stopping")[-1]
    assert router_done <= min(stages_stopping), "the router drained before the stages were told to stop"
    assert max(stages_done) <= scheduler_stopping, "the stages drained before the scheduler was told to stop"
    assert "stopped" in (up.log_dir / "up.out").read_text()
