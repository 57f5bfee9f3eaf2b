"""`stagemesh up` as a supervisor: a child that exits while the mesh is up (a crash, a kill, a stage drained
by `stagemesh roll`) is started again with backoff, and rejoins through the registry; the other chains
serve meanwhile. What it supervises (every child's pid and address, the exits it saw) is kept in
LOG_DIR/mesh.json, for `stagemesh roll` and for operators."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stagemesh.processes import LocalMesh, Process

log = logging.getLogger("stagemesh.up")
STATE_FILE = "mesh.json"
MAX_EXITS_KEPT = 200


@dataclass(frozen=True)
class RestartPolicy:
    first_s: float = 0.5
    """Delay before the first restart; it doubles with each exit in a row that came soon after a start."""
    max_s: float = 30.0
    """The longest delay."""
    reset_after_s: float = 60.0
    """A process that ran this long before exiting starts the backoff over."""
    start_timeout_s: float = 120.0
    """A restarted process that has not printed its ready line by then is killed (and restarted later)."""

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2 ** min(failures, 32))


def restart_args(proc: Process) -> list[str]:
    """A restarted process's flags. A stage that follows a registry may come back on any port: the registry
    carries its new address. Every other process comes back on the port it had, since others know it by it
    (the router's callers; the stages and the router that use the registry the scheduler hosts; a --chain)."""
    args = list(proc.args)
    m = re.fullmatch(r".+:(\d+)", proc.address)
    if m is None or (proc.role == "stage" and "--registry" in args):
        return args
    flag = "--registry-port" if proc.role == "scheduler" else "--port"
    if proc.role == "scheduler" and flag not in args:
        return args  # it follows an outside registry: nothing of its own to pin
    if flag in args:
        args[args.index(flag) + 1] = m.group(1)
    else:
        args += [flag, m.group(1)]
    return args


@dataclass
class _Slot:
    """One name's history: consecutive quick exits (the backoff), restarts, and a restart that is due."""

    failures: int = 0
    restarts: int = 0
    restart_at: float | None = None
    announced: int | None = None  # the pid whose readiness was logged


class Supervisor:
    def __init__(self, mesh: LocalMesh, policy: RestartPolicy | None = None, info: dict | None = None):
        self.mesh = mesh
        self.policy = policy or RestartPolicy()
        self.info = dict(info or {})
        self.state_path = mesh.log_dir / STATE_FILE
        self.slots: dict[str, _Slot] = {p.name: _Slot() for p in mesh.processes}
        self.exits: list[dict] = []
        self._written: dict | None = None

    def run(self, stop: threading.Event, interval_s: float = 0.2) -> None:
        """Supervises until stop is set (the caller then stops the mesh)."""
        while not stop.is_set():
            self.tick()
            stop.wait(interval_s)

    def tick(self) -> None:
        """Notes exits, restarts what is due, kills a restart that never got ready; writes the state."""
        now = time.monotonic()
        for proc in list(self.mesh.processes):
            slot = self.slots.setdefault(proc.name, _Slot())
            if proc.running():
                if proc.ready.is_set():
                    if slot.restarts and slot.announced != proc.pid:
                        slot.announced = proc.pid
                        log.info(f"{proc.name} is back: pid {proc.pid} on {proc.address}")
                elif now - proc.started_at > self.policy.start_timeout_s:
                    log.warning(f"{proc.name} (pid {proc.pid}) was not ready {self.policy.start_timeout_s:.0f}s "
                                f"after its start; killing it (see {proc.log_path})")
                    proc.popen.kill()
            elif slot.restart_at is None:
                self._exited(proc, slot, now)
            elif now >= slot.restart_at:
                self._restart(proc, slot)
        self.write_state()

    def _exited(self, proc: Process, slot: _Slot, now: float) -> None:
        ran = now - proc.started_at
        if ran >= self.policy.reset_after_s:
            slot.failures = 0
        delay = self.policy.delay(slot.failures)
        slot.failures += 1
        slot.restart_at = now + delay
        code = proc.popen.returncode
        self.exits.append({"name": proc.name, "pid": proc.pid, "returncode": code, "ran_s": round(ran, 3),
                           "at": time.time()})
        del self.exits[:-MAX_EXITS_KEPT]
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        # Code 0 is a clean exit, as after a drain (`stagemesh roll`); anything else is a crash or a kill.
        log.log(logging.INFO if code == 0 else logging.WARNING,
                f"{proc.name} (pid {proc.pid}) exited with {how} after {ran:.1f}s; restarting it in {delay:.1f}s "
                f"(its log: {proc.log_path})")

    def _restart(self, proc: Process, slot: _Slot) -> None:
        slot.restart_at = None
        slot.restarts += 1
        try:
            new = self.mesh.launch(proc.name, restart_args(proc), proc.env or dict(os.environ), append_log=True)
        except OSError as exc:  # cannot even start: counts as an exit, tried again after the backoff
            slot.restart_at = time.monotonic() + self.policy.delay(slot.failures)
            slot.failures += 1
            log.error(f"cannot restart {proc.name}: {exc}")
            return
        self.mesh.replace(proc, new)
        log.info(f"restarting {proc.name} (restart {slot.restarts}): pid {new.pid}")

    def state(self) -> dict:
        return {
            **self.info,
            "supervisor_pid": os.getpid(),
            "log_dir": str(self.mesh.log_dir),
            "registry": self.mesh.registry_url,
            "processes": [{"name": p.name, "role": p.role, "pid": p.pid, "address": p.address,
                           "ready": p.ready.is_set(), "restarts": self.slots.get(p.name, _Slot()).restarts,
                           "log": str(p.log_path)} for p in self.mesh.processes],
            "exits": list(self.exits),
        }

    def write_state(self, **extra) -> None:
        """LOG_DIR/mesh.json, replaced atomically when anything changed."""
        state = {**self.state(), **extra}
        if state == self._written:
            return
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)
        self._written = state


def state_path(mesh: str | Path) -> Path:
    """A `stagemesh up` log directory or its mesh.json."""
    path = Path(mesh)
    return path / STATE_FILE if path.is_dir() else path


def read_state(mesh: str | Path) -> dict:
    path = state_path(mesh)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; give the log directory `stagemesh up` printed "
                                "(it holds mesh.json)") from None
