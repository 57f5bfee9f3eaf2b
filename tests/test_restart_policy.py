"""The supervisor's rules, on real (short-lived) processes: backoff that doubles and starts over after a
long run, the state it writes, and the flags a restarted process gets (which ports are pinned)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from stagemesh.processes import LocalMesh, Process
from stagemesh.supervisor import RestartPolicy, Supervisor, read_state, restart_args


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(first_s=0.5, max_s=30.0)
    assert [policy.delay(i) for i in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.delay(10_000) == 30.0


def process(args: list[str], address: str) -> Process:
    return Process("x", None, None, address=address, args=args)


def test_a_restart_keeps_the_ports_others_know_and_lets_a_registered_stage_take_any():
    registered = ["stage", "--model", "m", "--registry", "local://127.0.0.1:5", "--memory-gb", "1"]
    assert restart_args(process(registered, "127.0.0.1:41000")) == registered
    fixed = ["stage", "--model", "m", "--layers", "0:4"]
    assert restart_args(process(fixed, "127.0.0.1:41001")) == [*fixed, "--port", "41001"]
    router = ["router", "--model", "m", "--port", "0", "--registry", "local://127.0.0.1:5"]
    assert restart_args(process(router, "127.0.0.1:41002"))[3:5] == ["--port", "41002"]
    hosting = ["scheduler", "--model", "m", "--registry", "local", "--registry-port", "0"]
    assert restart_args(process(hosting, "127.0.0.1:41003"))[-2:] == ["--registry-port", "41003"]
    outside = ["scheduler", "--model", "m", "--registry", "consul://127.0.0.1:8500"]
    assert restart_args(process(outside, "(scheduler-1a2b3c4d,")) == outside


def exited(mesh: LocalMesh, name: str, code: int, ran_s: float = 0.0) -> Process:
    popen = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"], stdout=subprocess.PIPE, text=True)
    popen.wait(timeout=30)
    proc = Process(name, popen, mesh.log_dir / f"{name}.log", address="127.0.0.1:1", args=["registry"],
                   started_at=time.monotonic() - ran_s)
    mesh.processes.append(proc)
    return proc


def test_exits_are_recorded_backoff_grows_for_quick_exits_and_starts_over_after_a_long_run(tmp_path):
    mesh = LocalMesh("m", tmp_path)
    quick, long_run = exited(mesh, "quick", 3), exited(mesh, "long", 0, ran_s=1000)
    supervisor = Supervisor(mesh, RestartPolicy(first_s=60.0, max_s=600.0, reset_after_s=100.0))
    supervisor.slots["quick"].failures = supervisor.slots["long"].failures = 2  # as after two quick exits
    t0 = time.monotonic()
    supervisor.tick()
    assert supervisor.slots["quick"].restart_at - t0 >= 4 * 60.0 - 1  # a third quick exit: 60 s doubled twice
    assert supervisor.slots["long"].restart_at - t0 <= 60.0 + 1  # ran long: the backoff started over
    state = read_state(tmp_path)
    assert [(e["name"], e["pid"], e["returncode"]) for e in state["exits"]] == [
        ("quick", quick.pid, 3), ("long", long_run.pid, 0)]
    assert [p["name"] for p in state["processes"]] == ["quick", "long"]
    assert mesh.processes == [quick, long_run], "nothing restarted before its time"


def test_a_due_restart_starts_the_process_again_and_its_exit_counts(tmp_path):
    mesh = LocalMesh("m", tmp_path)
    first = exited(mesh, "registry", 2)
    first.args = ["registry", "--port", "70000"]  # refused at once: the restarted process exits 2 as well
    first.address = ""  # it never served: no port to keep
    supervisor = Supervisor(mesh, RestartPolicy(first_s=0.01, max_s=1.0))
    supervisor.tick()
    deadline = time.monotonic() + 60
    while mesh.processes[0] is first:
        assert time.monotonic() < deadline
        time.sleep(0.02)
        supervisor.tick()
    second = mesh.processes[0]
    assert mesh.retired == [first] and second.args == ["registry", "--port", "70000"]
    assert second.popen.wait(timeout=60) == 2
    supervisor.tick()
    assert supervisor.slots["registry"].failures == 2 and supervisor.slots["registry"].restarts == 1
    assert [e["pid"] for e in read_state(tmp_path)["exits"]] == [first.pid, second.pid]
    assert "--port 70000: must be 0..65535" in second.log_path.read_text()


PARENT = """
import sys, time
from pathlib import Path
from stagemesh.launcher import stage_env
from stagemesh.processes import LocalMesh
child = LocalMesh("m", Path(sys.argv[1])).spawn("registry", ["registry", "--port", "0"], stage_env(1))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_stops_when_its_parent_is_killed(tmp_path):
    """A child of a LocalMesh (as of `stagemesh up`) whose parent dies by SIGKILL gets SIGTERM from the
    kernel and exits: nothing serves on unsupervised."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.ppid() == parent.pid
        parent.kill()
        parent.wait(timeout=30)
        child.wait(timeout=60)  # psutil.TimeoutExpired if it serves on (its exit code is its parent's to read)
        assert not child.is_running()
    finally:
        if parent.poll() is None:
            parent.kill()
