"""Admission: requests wait here, by priority class, until a chain has room for one more stream.

Higher classes go first. Within a class callers (their tokens' names; "" without --auth-tokens) take turns, by
start-time fair queuing (_ClassQueue), so that one caller's hundred queued requests do not delay another's one
past the next free slot. A class's oldest waiter gains urgency with its wait, up to
one class per `aging_s` seconds and never more than that: an aged batch request ranks with a fresh normal one
(before it, being older), never above a normal one that waited, and never near a high one; a flood of one class
cannot hold the next class's requests back. Each class bounds how many may wait and how long, and each caller's
CallerLimits (the tokens file) how many of its requests run and wait, and how many tokens it asks for a minute;
past a bound the caller is told so (RESOURCE_EXHAUSTED naming the limit, DEADLINE_EXCEEDED) instead of waiting.

Waiters live in a heap per class: an admission or a release touches the heads only (a waiter that left is marked
and dropped when it comes up), never every waiter.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from stagemesh import metrics
from stagemesh.config_flags import refused
from stagemesh.errors import StatusError
from stagemesh.router.auth import NO_LIMITS, CallerLimits, TokenBucket

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
    """Seconds of waiting that lift a class's oldest request to the next class's fresh ones (never above them)."""
    max_stream_seconds: float = 0.0
    """A stream that runs longer than this (from its admission) is ended with RESOURCE_EXHAUSTED and its slot freed,
    so that no caller holds slots with endless or unread streams (0: no limit)."""
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
        if not self.max_stream_seconds >= 0:
            raise refused(self, "max_stream_seconds", "must be >= 0 seconds (0: no limit)")
        if sorted(self.limits) != sorted(CLASSES):
            raise ValueError(f"admission limits for {sorted(self.limits)}: give one for each of {', '.join(CLASSES)}")
        for cls in CLASSES:
            if not self.limits[cls].max_waiting >= 0:
                raise refused(self, f"limits.{cls}.max_waiting", "must be >= 0 requests (0: none waits)")
            if not self.limits[cls].max_wait_s > 0:
                raise refused(self, f"limits.{cls}.max_wait_s", "must be > 0 seconds")


class AdmissionRefused(StatusError):
    """The request may not wait for a slot: it reaches the caller with this code and message."""


TOKENS_WINDOW_S = 60.0
"""tokens_per_minute's window: the bucket holds a minute's tokens and refills over a minute."""


@dataclass(eq=False)
class _Waiter:
    cls: str
    caller: str
    limits: CallerLimits
    enqueued: float
    seq: int
    future: asyncio.Future
    tag: float = 0.0
    """Its start tag in its class's fair queue: served in tag order."""
    gone: bool = False
    """Left the queue (admitted, timed out, cancelled): skipped where it still sits in a heap or deque."""


@dataclass(frozen=True)
class Ticket:
    """An admitted request, for release(): whose slot it holds and the tokens it was charged."""

    caller: str = ""
    charged: int = 0


class _ClassQueue:
    """One class's waiters, in start-time fair queuing: a request's tag is the later of the class's virtual time
    (the tag last let in) and its caller's previous request's tag + 1, and the smallest tag goes first. A caller's
    requests thus take every other caller's turn between them: a caller with 200 queued has tags far ahead, and
    another caller's one request, tagged at the virtual time, goes next."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, _Waiter]] = []
        self.parked: dict[str, list[_Waiter]] = {}
        """Waiters of callers at their max_concurrent, out of the heap until one of their streams ends."""
        self.arrivals: deque[_Waiter] = deque()
        self.count = 0
        self.virtual = 0.0
        self.finish: dict[str, float] = {}
        """Each caller's last tag + 1 (one unit per request)."""

    def charge(self, caller: str) -> float:
        """The next tag of caller's, its turn taken."""
        tag = max(self.virtual, self.finish.get(caller, 0.0))
        self.finish[caller] = tag + 1
        return tag

    def add(self, waiter: _Waiter) -> None:
        waiter.tag = self.charge(waiter.caller)
        heapq.heappush(self.heap, (waiter.tag, waiter.seq, waiter))
        self.arrivals.append(waiter)
        self.count += 1

    def unpark(self, caller: str) -> None:
        for waiter in self.parked.pop(caller, ()):
            heapq.heappush(self.heap, (waiter.tag, waiter.seq, waiter))

    def oldest(self) -> _Waiter | None:
        while self.arrivals and self.arrivals[0].gone:
            self.arrivals.popleft()
        return self.arrivals[0] if self.arrivals else None

    def first(self) -> _Waiter | None:
        """The waiter with the smallest tag still waiting (those that left are dropped on the way)."""
        while self.heap and self.heap[0][2].gone:
            heapq.heappop(self.heap)
        return self.heap[0][2] if self.heap else None


class PriorityAdmission:
    """Owned by the event loop: no locks; every change happens between awaits."""

    def _gauges(self) -> None:
        metrics.RUNNING.set(self.running)
        metrics.WAITING.set(sum(q.count for q in self.queues.values()))

    def __init__(self, config: AdmissionConfig, usable_chains: Callable[[], int]):
        self.config = config
        self.usable_chains = usable_chains
        self.running = 0
        self.queues = {cls: _ClassQueue() for cls in CLASSES}
        self.running_by: Counter[str] = Counter()
        self.waiting_by: Counter[str] = Counter()
        self.budgets: dict[str, TokenBucket] = {}
        """Each caller's tokens_per_minute bucket, kept while its limit is unchanged."""
        self._seq = itertools.count()

    @property
    def slots(self) -> int:
        return self.config.slots_per_chain * self.usable_chains()

    @property
    def waiting(self) -> list[_Waiter]:
        """Every waiter, in no particular order (for tests and looks; admission never walks it)."""
        return [w for q in self.queues.values() for w in q.arrivals if not w.gone]

    def waiting_in(self, cls: str) -> int:
        return self.queues[cls].count

    def _budget(self, caller: str, limits: CallerLimits) -> TokenBucket | None:
        per_minute = limits.tokens_per_minute
        if per_minute is None:
            self.budgets.pop(caller, None)
            return None
        bucket = self.budgets.get(caller)
        if bucket is None or bucket.capacity != per_minute:
            bucket = self.budgets[caller] = TokenBucket(per_minute / TOKENS_WINDOW_S, capacity=per_minute)
        return bucket

    def _charge(self, caller: str, limits: CallerLimits, prompt_tokens: int, max_new_tokens: int) -> int:
        """Holds the request to its caller's max_new_tokens and tokens_per_minute; returns the tokens charged."""
        who = f"caller {caller!r}"
        if limits.max_new_tokens is not None and max_new_tokens > limits.max_new_tokens:
            raise AdmissionRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"max_new_tokens {max_new_tokens} is above {who}'s max_new_tokens limit "
                                   f"{limits.max_new_tokens}: ask for fewer")
        cost = prompt_tokens + max_new_tokens
        bucket = self._budget(caller, limits)
        if bucket is None:
            return 0
        if not bucket.take(cost):
            more = "more than it allows at all: shorten the prompt or max_new_tokens" if cost > bucket.capacity \
                else "retry later"
            raise AdmissionRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{who} is over its tokens_per_minute limit {limits.tokens_per_minute} (this "
                                   f"request asks for {cost}: prompt + max_new_tokens); {more}")
        return cost

    def _refund(self, caller: str, tokens: int) -> None:
        bucket = self.budgets.get(caller)
        if bucket is not None and tokens > 0:
            bucket.give(tokens)

    def _may_run(self, caller: str, limits: CallerLimits) -> bool:
        return limits.max_concurrent is None or self.running_by[caller] < limits.max_concurrent

    def _admit(self, caller: str) -> None:
        self.running += 1
        self.running_by[caller] += 1

    async def acquire(self, priority: int, deadline: float | None = None, caller: str = "",
                      limits: CallerLimits = NO_LIMITS, prompt_tokens: int = 0, max_new_tokens: int = 0) -> Ticket:
        """Returns when the request may run; the caller must release() the ticket when it ends."""
        cls = priority_class(priority)
        if self.usable_chains() == 0:
            raise AdmissionRefused(
                grpc.StatusCode.UNAVAILABLE,
                "no usable pipeline chain: every chain has a stage that is down or not serving; retry later, "
                "or check the stage servers (ListChains shows each chain)",
            )
        charged = self._charge(caller, limits, prompt_tokens, max_new_tokens)
        ticket = Ticket(caller, charged)
        if self.running < self.slots and not any(q.count for q in self.queues.values()) \
                and self._may_run(caller, limits):
            queue = self.queues[cls]  # served now: its tag is the virtual time, as for a waiter let in
            queue.virtual = max(queue.virtual, queue.charge(caller))
            self._admit(caller)
            self._gauges()
            return ticket
        try:
            waiter = self._enqueue(cls, caller, limits)
        except AdmissionRefused:
            self._refund(caller, charged)
            raise
        await self._wait(waiter, deadline, ticket)
        return ticket

    def _enqueue(self, cls: str, caller: str, limits: CallerLimits) -> _Waiter:
        class_limits = self.config.limits[cls]
        if self.queues[cls].count >= class_limits.max_waiting:
            raise AdmissionRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {cls}-priority queue is full ({class_limits.max_waiting} waiting); retry later with backoff",
            )
        if limits.max_queued is not None and self.waiting_by[caller] >= limits.max_queued:
            raise AdmissionRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"caller {caller!r} has {self.waiting_by[caller]} requests waiting, its max_queued limit: retry "
                "when some have started",
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(cls, caller, limits, loop.time(), next(self._seq), loop.create_future())
        self.queues[cls].add(waiter)
        self.waiting_by[caller] += 1
        self._grant()  # a free slot that only this caller's own limit kept is taken by another caller's waiter
        return waiter

    def _leave(self, waiter: _Waiter) -> None:
        waiter.gone = True
        self.queues[waiter.cls].count -= 1
        self.waiting_by[waiter.caller] -= 1
        if not self.waiting_by[waiter.caller]:
            del self.waiting_by[waiter.caller]

    async def _wait(self, waiter: _Waiter, deadline: float | None, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        self._gauges()
        timeout = self.config.limits[waiter.cls].max_wait_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - loop.time()))
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            if waiter.future.done():  # granted at the last moment: keep it
                return
            self._leave(waiter)
            self._refund(ticket.caller, ticket.charged)
            self._gauges()
            raise AdmissionRefused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"waited {loop.time() - waiter.enqueued:.1f}s in the {waiter.cls}-priority queue without a free "
                "slot; the mesh is saturated: retry later or add chains",
            ) from None
        except asyncio.CancelledError:
            if waiter.future.done():
                self.release(ticket)  # the slot was granted to a caller that left
            else:
                self._leave(waiter)
                self._refund(ticket.caller, ticket.charged)
                self._gauges()
            raise

    def release(self, ticket: Ticket = Ticket(), used_tokens: int | None = None) -> None:
        """The request's stream ended: its slot is free, and of its charge what it did not use (used_tokens: its
        prompt and the tokens it generated) goes back to its caller's tokens_per_minute."""
        self.running -= 1
        self.running_by[ticket.caller] -= 1
        if not self.running_by[ticket.caller]:
            del self.running_by[ticket.caller]
        if used_tokens is not None:
            self._refund(ticket.caller, ticket.charged - used_tokens)
        for queue in self.queues.values():  # a caller held at its max_concurrent may take its turn again
            queue.unpark(ticket.caller)
        self._grant()

    def capacity_changed(self) -> None:
        """Call when chains come or go: more room lets waiters in."""
        self._grant()

    def _rank(self, cls: str, now: float) -> tuple[float, int] | None:
        """The class's urgency, from its oldest waiter's wait (at most one class more), or None when no waiter of
        it may run now; larger first, then the older."""
        queue = self.queues[cls]
        oldest = queue.oldest() if queue.first() is not None else None
        if oldest is None:
            return None
        return CLASSES.index(cls) + min((now - oldest.enqueued) / self.config.aging_s, 1.0), -oldest.seq

    def _next(self, now: float) -> _Waiter | None:
        """The waiter to let in next: the most urgent class's smallest tag (callers at their max_concurrent
        parked on the way)."""
        while True:
            ranked = [(rank, cls) for cls in CLASSES if (rank := self._rank(cls, now)) is not None]
            if not ranked:
                return None
            queue = self.queues[max(ranked)[1]]
            waiter = queue.first()
            heapq.heappop(queue.heap)
            if not self._may_run(waiter.caller, waiter.limits):
                queue.parked.setdefault(waiter.caller, []).append(waiter)
                continue
            queue.virtual = max(queue.virtual, waiter.tag)
            return waiter

    def _grant(self) -> None:
        """Lets in the most urgent waiters while there is room; the gauges follow."""
        now = asyncio.get_running_loop().time()
        while self.running < self.slots and (waiter := self._next(now)) is not None:
            self._leave(waiter)
            self._admit(waiter.caller)
            waiter.future.set_result(None)
        self._gauges()
