"""Admission: requests wait here, by priority class, until a chain has room for one more stream.

Higher classes go first; a waiting request gains one class of urgency per `aging_s` seconds so
that none starves; each class has a bound on how many may wait and on how long, past which the
caller is told so (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED) instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from stagemesh import metrics
from stagemesh.config_flags import refused
from stagemesh.errors import StatusError

CLASSES = ("batch", "normal", "high")  # index = rank: higher goes first


def priority_class(priority: int) -> str:
    """GenerateRequest.priority: > 0 high, 0 normal, < 0 batch."""
    return "high" if priority > 0 else "normal" if priority == 0 else "batch"


@dataclass
class ClassLimits:
    """One priority class's queue; AdmissionConfig checks its bounds (it knows the class's flags)."""

    max_waiting: int = 1000
    """Requests of this class that may wait at once; the next one is refused (0: none waits)."""
    max_wait_s: float = 60.0
    """Seconds one may wait for a slot before it is refused."""


@dataclass
class AdmissionConfig:
    slots_per_chain: int = 32
    """Streams that may run at once on one chain; the router's capacity is this times its usable chains."""
    aging_s: float = field(default=10.0, metadata={"deprecated": "--aging"})
    """Seconds of waiting worth one class of urgency."""
    limits: dict[str, ClassLimits] = field(
        default_factory=lambda: {
            "high": ClassLimits(max_waiting=1000, max_wait_s=60.0),
            "normal": ClassLimits(max_waiting=1000, max_wait_s=60.0),
            "batch": ClassLimits(max_waiting=10000, max_wait_s=600.0),
        }
    )
    """Each priority class's queue (flags --high-max-waiting, --normal-max-wait-s, ...)."""

    def __post_init__(self) -> None:
        if not self.slots_per_chain >= 1:
            raise refused(self, "slots_per_chain", "must be >= 1 stream per chain")
        if not self.aging_s > 0:
            raise refused(self, "aging_s", "must be > 0 seconds of waiting per class of urgency")
        if sorted(self.limits) != sorted(CLASSES):
            raise ValueError(f"admission limits for {sorted(self.limits)}: give one for each of {', '.join(CLASSES)}")
        for cls in CLASSES:
            if not self.limits[cls].max_waiting >= 0:
                raise refused(self, f"limits.{cls}.max_waiting", "must be >= 0 requests (0: none waits)")
            if not self.limits[cls].max_wait_s > 0:
                raise refused(self, f"limits.{cls}.max_wait_s", "must be > 0 seconds")


class AdmissionRefused(StatusError):
    """The request may not wait for a slot: it reaches the caller with this code and message."""


@dataclass
class _Waiter:
    cls: str
    enqueued: float
    seq: int
    future: asyncio.Future


class PriorityAdmission:
    """Owned by the event loop: no locks; every change happens between awaits."""

    def _gauges(self) -> None:
        metrics.RUNNING.set(self.running)
        metrics.WAITING.set(len(self.waiting))

    def __init__(self, config: AdmissionConfig, usable_chains: Callable[[], int]):
        self.config = config
        self.usable_chains = usable_chains
        self.running = 0
        self.waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def slots(self) -> int:
        return self.config.slots_per_chain * self.usable_chains()

    def waiting_in(self, cls: str) -> int:
        return sum(1 for w in self.waiting if w.cls == cls)

    def _score(self, w: _Waiter, now: float) -> tuple[float, int]:
        rank = CLASSES.index(w.cls) + (now - w.enqueued) / self.config.aging_s
        return (-rank, w.seq)  # smallest first: most urgent, then oldest

    async def acquire(self, priority: int, deadline: float | None = None) -> None:
        """Returns when the request may run; the caller must call release() when it ends."""
        cls = priority_class(priority)
        if self.usable_chains() == 0:
            raise AdmissionRefused(
                grpc.StatusCode.UNAVAILABLE,
                "no usable pipeline chain: every chain has a stage that is down or not serving; retry later, "
                "or check the stage servers (ListChains shows each chain)",
            )
        if self.running < self.slots and not self.waiting:
            self.running += 1
            self._gauges()
            return
        limits = self.config.limits[cls]
        if self.waiting_in(cls) >= limits.max_waiting:
            raise AdmissionRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {cls}-priority queue is full ({limits.max_waiting} waiting); retry later with backoff",
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(cls, loop.time(), next(self._seq), loop.create_future())
        self.waiting.append(waiter)
        self._gauges()
        timeout = limits.max_wait_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - loop.time()))
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            if waiter.future.done():  # granted at the last moment: keep it
                return
            self.waiting.remove(waiter)
            self._gauges()
            raise AdmissionRefused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"waited {loop.time() - waiter.enqueued:.1f}s in the {cls}-priority queue without a free "
                "slot; the mesh is saturated: retry later or add chains",
            ) from None
        except asyncio.CancelledError:
            if waiter.future.done():
                self.release()  # the slot was granted to a caller that left
            else:
                self.waiting.remove(waiter)
                self._gauges()
            raise

    def release(self) -> None:
        self.running -= 1
        self._grant()

    def capacity_changed(self) -> None:
        """Call when chains come or go: more room lets waiters in."""
        self._grant()

    def _grant(self) -> None:
        """Lets in the most urgent waiters while there is room; the gauges follow."""
        now = asyncio.get_running_loop().time()
        while self.waiting and self.running < self.slots:
            best = min(self.waiting, key=lambda w: self._score(w, now))
            self.waiting.remove(best)
            self.running += 1
            best.future.set_result(None)
        self._gauges()
