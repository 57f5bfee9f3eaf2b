"""End-to-end chain probes: a tiny step through a whole chain, stage to stage as real traffic flows, decides the
chain's health alongside its stages' own checks (router/chains.py). A stage answers its health check alone; only
a step through the chain sees the links between its stages (a partition between two stages that the router
reaches both of, a next stage's address that does not route).

A probe opens a session of a few positions on every stage with the chain's hop keys, steps one token from the
router to the first stage and waits for the last stage's token within its deadline, then closes the session (on
every path: it holds no KV cache after). A chain whose probes fail `probe_failures` times in a row is held down
(ChainSet.hold): its streams fail over at once and it stays out, whatever its stages' checks say, until a probe
passes again."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from stagemesh import metrics
from stagemesh.config_flags import refused
from stagemesh.router.chain_client import Chain, Progress
from stagemesh.router.chains import ChainSet
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling

log = logging.getLogger("stagemesh.router")

PROBE_POSITIONS = 4
"""The probe session's length: one token is stepped; a few positions are all it may ever hold."""
PROBE_TOKEN = 0
"""The token id stepped (any id of the vocabulary does)."""
PASS, FAIL, BUSY = "pass", "fail", "busy"


@dataclass
class ChainProbeConfig:
    probe_interval_s: float = 1.0
    """Seconds between end-to-end probes of each chain (one token stepped through all its stages, as real traffic
    flows): a chain whose probes fail --probe-failures times in a row is taken out, its streams fail over at once,
    and it stays out until a probe passes again (0: no probes, the stages' own health checks alone)."""
    probe_timeout_s: float = 1.0
    """A probe's deadline for the last stage's token: this floor plus a margin scaled by the chain's reported step
    and pass times (as a stream's progress timeout is)."""
    probe_failures: int = 2
    """Probes in a row that must fail before the chain is taken out."""

    def __post_init__(self) -> None:
        if not self.probe_interval_s >= 0:
            raise refused(self, "probe_interval_s", "must be >= 0 seconds (0: no end-to-end probes)")
        if not self.probe_timeout_s > 0:
            raise refused(self, "probe_timeout_s", "must be > 0 seconds")
        if not self.probe_failures >= 1:
            raise refused(self, "probe_failures", "must be >= 1 probe")


class ChainProber:
    """Probes every chain of a ChainSet: those in service every probe_interval_s (busy or idle), and those held
    down by failed probes as often, to see them pass again."""

    def __init__(self, chains: ChainSet, config: ChainProbeConfig, wire_dtype: str = ""):
        self.chains = chains
        self.config = config
        self.wire_dtype = wire_dtype
        self.failures: dict[str, int] = {}  # failed probes in a row, by chain id
        self._running: dict[str, asyncio.Task] = {}

    async def probe(self, chain: Chain) -> str:
        """One probe: PASS (the last stage's token came in time), FAIL, or BUSY (a stage had no room for the
        session: the chain is full, not broken; it counts neither way). Logged with its request id when it
        fails; counted in stagemesh_router_chain_probes_total."""
        request_id = f"probe-{secrets.token_hex(6)}"
        progress = Progress(floor_s=self.config.probe_timeout_s)
        bound = 2 * progress.timeout(chain, 1) + 1.0  # open and step each have the session's own deadline
        try:
            async with asyncio.timeout(bound):
                async with ChainSession(chain, PROBE_POSITIONS, request_id, wire_dtype=self.wire_dtype,
                                        progress=progress) as session:
                    chain.sessions.discard(session)  # not a stream: the chain marked down does not abort it
                    await session.step([PROBE_TOKEN], sampling=Sampling())
            outcome, why = PASS, ""
        except grpc.aio.AioRpcError as exc:
            outcome = BUSY if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else FAIL
            why = f"{exc.code().name}: {exc.details()}"
        except TimeoutError:
            outcome, why = FAIL, f"no answer in {bound:.1f}s"
        metrics.CHAIN_PROBES.labels(outcome).inc()
        if outcome == FAIL:
            log.warning(f"chain {chain.chain_id} ({chain.label}): end-to-end probe {request_id} failed: {why}",
                        extra={"chain": chain.chain_id, "request_id": request_id})
        else:
            log.debug(f"chain {chain.chain_id}: end-to-end probe {request_id}: {outcome}",
                      extra={"chain": chain.chain_id, "request_id": request_id})
        return outcome if outcome != FAIL else f"{FAIL}: {why}"

    async def run(self, chain: Chain) -> None:
        """Probes a chain until a probe passes, or --probe-failures have failed in a row (then it is held down), or
        one finds it full or its streams answered meanwhile; a chain held down, once."""
        held = chain.chain_id in self.chains.held
        for _ in range(1 if held else self.config.probe_failures):
            started = time.monotonic()
            outcome = await self.probe(chain)
            if chain.withdrawn:
                return
            if outcome == PASS:
                self.failures.pop(chain.chain_id, None)
                self.chains.unhold(chain)
                return
            if outcome == BUSY or chain.answered_at > started:
                # Full, or streams got the last stage's answers while the probe waited (its step stuck behind a
                # queue the stages had not reported yet): traffic gets through, so the path is not broken.
                return
            if await self.chains.check(chain) is False:
                # A stage is down by its own check (draining, stopped, not serving its range): the health checks
                # take the chain out, and a draining stage's streams finish; holding it would cut them.
                return
            failures = self.failures[chain.chain_id] = self.failures.get(chain.chain_id, 0) + 1
            if failures >= self.config.probe_failures and not held:
                self.chains.hold(chain, f"its end-to-end probe failed {failures} times in a row "
                                        f"(last: {outcome.removeprefix(FAIL + ': ')})")
                return

    def due(self) -> list[Chain]:
        """The chains to probe now: in service, or held down by their probes; none already being probed."""
        return [c for c in self.chains.chains if (c.healthy or c.chain_id in self.chains.held)
                and not c.withdrawn and c.chain_id not in self._running]

    def start_due(self) -> list[asyncio.Task]:
        """Starts a run() for every chain due; their tasks."""
        tasks = []
        for chain in self.due():
            task = self._running[chain.chain_id] = asyncio.get_running_loop().create_task(self.run(chain))
            task.add_done_callback(lambda _t, chain_id=chain.chain_id: self._running.pop(chain_id, None))
            tasks.append(task)
        return tasks

    async def watch(self) -> None:
        """Probes every chain due, every probe_interval_s, until cancelled (then the probes in flight are too:
        each closes its session as it ends)."""
        try:
            while True:
                self.start_due()
                known = {c.chain_id for c in self.chains.chains}
                self.failures = {k: n for k, n in self.failures.items() if k in known}
                await asyncio.sleep(self.config.probe_interval_s)
        finally:
            for task in list(self._running.values()):
                task.cancel()
