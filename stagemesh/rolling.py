"""`stagemesh roll`: a rolling restart of every stage of a running, supervised `stagemesh up`, one at a time.
Each stage is drained (SIGTERM: out of the registry, no new sessions, its streams finish), and the next one
goes only once the supervisor's replacement has registered, loaded the range the scheduler gave it, and the
router sees as many usable chains as before the roll. Callers see no error: new requests go to the other
chains meanwhile, and the streams on the draining stage finish on it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from stagemesh.config_flags import refused
from stagemesh.supervisor import read_state

DRAIN_MARGIN_S = 30.0
SETTLE_S = 3.0
"""Before a stage is taken down, the router must have seen every chain usable for this long without a break:
right after a replacement the scheduler may still be re-planning (withdrawing and re-publishing chains), and a
stage taken down then could be one of the last chain's."""
"""On top of the mesh's drain timeout: a stage still running after both is killed."""


class RollError(RuntimeError):
    """The roll stopped: a stage's replacement or the chains did not come back in time."""


@dataclass
class RollConfig:
    """`stagemesh roll`: restart every stage of a running `stagemesh up`, one by one, each drained first."""

    mesh: str
    """The running `stagemesh up`'s log directory (it prints it; it holds mesh.json), or that mesh.json."""
    timeout_s: float = 180.0
    """Per stage, after it exited: how long its replacement may take to start, register, load its range and
    have the router see the mesh's chains again (its drain is bounded by the mesh's --drain-timeout-s)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise refused(self, "timeout_s", "must be > 0 seconds (a stage's restart, load and rejoin)")


@dataclass(frozen=True)
class Rolled:
    name: str
    old_pid: int
    new_pid: int
    old_address: str
    new_address: str
    seconds: float


def usable_chains(router: str) -> list | None:
    """The router's healthy chains, or None when it does not answer."""
    import grpc

    from stagemesh.v1 import router_pb2, router_pb2_grpc

    try:
        with grpc.insecure_channel(router) as channel:
            reply = router_pb2_grpc.RouterStub(channel).ListChains(router_pb2.ListChainsRequest(), timeout=5)
    except grpc.RpcError:
        return None
    return [c for c in reply.chains if c.healthy]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(check: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.1):
    """check()'s first truthy value, polled until timeout_s; RollError naming what did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := check():
            return value
        if time.monotonic() > deadline:
            raise RollError(f"{what} within {timeout_s:.0f}s")
        time.sleep(interval_s)


def _wait_settled(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    """Returns once check() has held for SETTLE_S in a row (polled); RollError naming what did not happen."""
    since: float | None = None

    def held() -> bool:
        nonlocal since
        if not check():
            since = None
            return False
        since = since or time.monotonic()
        return time.monotonic() - since >= SETTLE_S

    _wait_for(held, timeout_s, what, interval_s)


def roll_stages(mesh: str | Path, timeout_s: float = 180.0, say: Callable[[str], None] = print) -> list[Rolled]:
    """Restarts every stage of the supervised mesh whose state is at `mesh` (log dir or mesh.json), one by
    one; returns what was replaced. Raises RollError (leaving the rest untouched) when one does not come back."""
    state = read_state(mesh)
    if not _alive(int(state["supervisor_pid"])) or state.get("stopped"):
        raise RollError(f"the `stagemesh up` of {mesh} is not running: nothing would restart a drained stage")
    router = state["router"]
    before = usable_chains(router)
    if before is None:
        raise RollError(f"the router {router} does not answer")
    drain_s = float(state.get("drain_timeout_s", 30.0))
    names = [p["name"] for p in state["processes"] if p["role"] == "stage"]
    say(f"rolling {len(names)} stage(s) one by one; the router has {len(before)} usable chain(s)")
    rolled = []
    for name in names:
        rolled.append(_roll_one(mesh, name, router, len(before), drain_s, timeout_s, say))
    say(f"rolled {len(rolled)} stage(s) in {sum(r.seconds for r in rolled):.1f}s")
    return rolled


def _current(mesh: str | Path, name: str) -> dict:
    return next(p for p in read_state(mesh)["processes"] if p["name"] == name)


def _roll_one(mesh: str | Path, name: str, router: str, chains: int, drain_s: float, timeout_s: float,
              say: Callable[[str], None]) -> Rolled:
    _wait_settled(lambda: len(usable_chains(router) or []) >= chains, timeout_s,
                  f"{name}: the router did not see {chains} usable chain(s), settled, before the stage was taken down")
    old = _current(mesh, name)
    t0 = time.monotonic()
    say(f"{name}: SIGTERM to pid {old['pid']} ({old['address']}): it drains for up to {drain_s:g}s")
    with contextlib.suppress(ProcessLookupError):
        os.kill(old["pid"], signal.SIGTERM)
    try:
        _wait_for(lambda: not _alive(old["pid"]), drain_s + DRAIN_MARGIN_S, f"{name} did not exit")
    except RollError:
        say(f"{name}: still running {drain_s + DRAIN_MARGIN_S:.0f}s after SIGTERM; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(old["pid"], signal.SIGKILL)
    say(f"{name}: exited after {time.monotonic() - t0:.1f}s; waiting for its replacement")
    new = _wait_for(lambda: (p := _current(mesh, name))["pid"] != old["pid"] and p["ready"] and p,
                    timeout_s, f"{name}: the supervisor started no replacement that got ready")

    def back() -> bool:
        usable = usable_chains(router)
        stale = old["address"] != new["address"]
        return usable is not None and len(usable) >= chains and not (
            stale and any(s.address == old["address"] for c in usable for s in c.stages))

    _wait_for(back, timeout_s, f"{name}: the router did not see {chains} usable chain(s) again")
    seconds = time.monotonic() - t0
    say(f"{name}: replaced by pid {new['pid']} ({new['address']}); {chains} chain(s) usable again after {seconds:.1f}s")
    return Rolled(name, old["pid"], new["pid"], old["address"], new["address"], seconds)


def run_roll(config: RollConfig) -> None:
    try:
        roll_stages(config.mesh, config.timeout_s, say=lambda line: print(line, flush=True))
    except RollError as exc:
        print(f"stagemesh roll: {exc}", file=sys.stderr)
        sys.exit(1)
