"""The processes of a local mesh: each `stagemesh` service started as a child process, known ready by the
line it prints ("stage ready on HOST:PORT"), and stopped in order: the router first (it drains the streams
it carries while the stages still serve them), then the stages, then the scheduler (and its registry)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("stagemesh.up")
READY = re.compile(r"(stage|router|registry|scheduler) ready (?:on )?(\S+)")
PARENT_PID_ENV = "STAGEMESH_PARENT_PID"
"""Set in every child's environment: the child asks the kernel for SIGTERM (its drain) when this parent
dies, so that a supervisor killed with SIGKILL leaves no orphans serving (stagemesh/cli.py)."""
STOP_ORDER = ("router", "stage", "scheduler", "registry")
"""Who is told to stop first: callers' streams drain at the router while the stages still serve them."""


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident memory (VmHWM, which unlike ru_maxrss is not inherited across exec from a fat
    parent); None where /proc has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    args: list[str] = field(default_factory=list)
    """The `stagemesh` subcommand and its flags, as started (a restart starts them again)."""
    env: dict[str, str] | None = None
    started_at: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set once the process printed its ready line (and `address` is known)."""

    @property
    def role(self) -> str:
        """stage, router, scheduler or registry: the subcommand."""
        return self.args[0] if self.args else self.name.split("-")[0]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None


def _read_stdout(proc: Process) -> None:
    """Takes the address from the ready line, then keeps reading so that the child never blocks on a full pipe."""
    for line in proc.popen.stdout:
        if not proc.ready.is_set() and (m := READY.search(line)):
            proc.address = m.group(2)
            proc.ready.set()


@dataclass
class LocalMesh:
    model: str
    log_dir: Path
    processes: list[Process] = field(default_factory=list)
    """The current process of each name (a restarted one takes its predecessor's place)."""
    registry_url: str = ""
    retired: list[Process] = field(default_factory=list)
    """Processes that exited and were replaced by a restart."""

    def launch(self, name: str, args: list[str], env: dict[str, str], append_log: bool = False,
               prefix: Sequence[str] = ()) -> Process:
        """Starts `stagemesh ARGS` without waiting for it (nor listing it in processes); its stderr goes to
        LOG_DIR/NAME.log (appended to for a restart). It gets its own session, so that Ctrl-C at a terminal
        reaches the supervisor alone, which stops the children in order. prefix: a command that execs it
        (e.g. `ip netns exec NS`, the way the namespace tests put a process on a host)."""
        log_path = self.log_dir / f"{name}.log"
        env = {**env, PARENT_PID_ENV: str(os.getpid())}
        with log_path.open("a" if append_log else "w") as stderr:
            popen = subprocess.Popen([*prefix, sys.executable, "-m", "stagemesh.cli", *args], stdout=subprocess.PIPE,
                                     stderr=stderr, env=env, text=True, start_new_session=True)
        proc = Process(name, popen, log_path, args=list(args), env=env)
        threading.Thread(target=_read_stdout, args=(proc,), name=f"{name}-stdout", daemon=True).start()
        return proc

    @staticmethod
    def wait_ready(proc: Process, timeout: float = 120.0) -> Process:
        """Until proc printed its ready line; RuntimeError (with its log's tail) if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while not proc.ready.wait(0.05):
            if proc.popen.poll() is not None and not proc.ready.wait(1.0):  # the reader may still hold the line
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before it was ready; "
                                   f"see {proc.log_path}:\n{proc.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} was not ready in {timeout:.0f}s; see {proc.log_path}:\n"
                                   f"{proc.log_path.read_text()[-2000:]}")
        return proc

    def spawn(self, name: str, args: list[str], env: dict[str, str], timeout: float = 120.0) -> Process:
        """Starts a process, lists it, and waits until it is ready."""
        return self.spawn_together([(name, args)], env, timeout)[0]

    def spawn_together(self, specs: list[tuple[str, list[str]]], env: dict[str, str],
                       timeout: float = 120.0) -> list[Process]:
        """Starts every (name, args) at once (their imports of torch overlap), lists them, and waits until all
        are ready: a mesh of N stages starts in about the time of N/cores stages, not N."""
        procs = [self.launch(name, args, env) for name, args in specs]
        self.processes.extend(procs)
        return [self.wait_ready(p, timeout) for p in procs]

    def replace(self, old: Process, new: Process) -> None:
        """new (a restart) takes old's place; old is kept in retired."""
        self.processes[self.processes.index(old)] = new
        self.retired.append(old)

    def send_signal(self, sig: int) -> None:
        """Sends sig to every process still running (SIGHUP: each reads its certificates and tokens again)."""
        for proc in self.processes:
            if proc.running():
                proc.popen.send_signal(sig)

    def shutdown(self, wait_s: float = 10.0) -> None:
        """SIGTERM to the router(s), wait for them (they drain), then the stages, then the scheduler; a
        group's stragglers are killed after wait_s."""
        rank = {role: i for i, role in enumerate(STOP_ORDER)}
        groups: dict[int, list[Process]] = {}
        for proc in self.processes:
            groups.setdefault(rank.get(proc.role, len(STOP_ORDER)), []).append(proc)
        for _, group in sorted(groups.items()):
            live = [p for p in group if p.running()]
            for proc in live:
                proc.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            for proc in live:
                try:
                    proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning(f"{proc.name} (pid {proc.pid}) did not stop in {wait_s:.0f}s of SIGTERM; killing it")
                    proc.popen.kill()
                    proc.popen.wait(timeout=10)

    def kill(self) -> None:
        for proc in self.processes:
            if proc.running():
                proc.popen.kill()
        for proc in self.processes:
            proc.popen.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM to every process at once (each drains what it carries), then wait; kill after 10 s. Quicker
        than shutdown(), whose order matters only while callers' streams are in flight."""
        for proc in reversed(self.processes):
            if proc.running():
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
