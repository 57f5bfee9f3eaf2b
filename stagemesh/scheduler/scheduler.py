"""The scheduler: watches the stage servers in the registry, places layers, and publishes the
pipeline chains that routers use. Several may run; only the holder of the leader lock acts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from stagemesh import metrics
from stagemesh.checkpoint import (
    QUANTIZE,
    DtypeChoice,
    ModelArgs,
    ModelFootprint,
    ServingDtype,
    read_config,
    serving_dtype,
)
from stagemesh.config_flags import NOT_A_FLAG, PORT_RULE, refused
from stagemesh.discovery.backends import plaintext_hosts
from stagemesh.discovery.chain_table import PublishedChain, PublishedStage, decode_chains, encode_chains
from stagemesh.discovery.registry import (
    Fence,
    LockLost,
    Registry,
    RegistryError,
    ServiceStatus,
    chains_key,
    holder_name,
    leader_key,
    parse_layers,
)
from stagemesh.scheduler import placement, tp_advice
from stagemesh.scheduler.assignments import Assignments, next_change
from stagemesh.scheduler.lapsed import LapsedStages
from stagemesh.tls import PlaintextConfig, Tls
from stagemesh.tracing import TracingConfig

log = logging.getLogger("stagemesh.scheduler")



@dataclass
class SchedulerConfig:
    model: str
    """Local checkpoint directory: the scheduler reads its config and tensor sizes (not its weights)."""
    model_name: str = ""
    """The model's name in the registry (default: the directory's name); stages and routers use the same."""
    dtype: DtypeChoice = "auto"
    """The dtype the stages serve in, for sizing (auto: what most live stages announce, before any announce the
    checkpoint's own)."""
    quantize: str = "auto"
    """The stages' --quantize, for sizing: int8 Linear weights let each host hold more layers (auto: what most
    live stages announce; none before any do)."""
    lock_ttl_s: float = field(default=3.0, metadata={"deprecated": "--lock-ttl"})
    """Seconds before a standby scheduler takes over from a leader that stopped renewing its lock."""
    placement: placement.PlacementConfig = field(default_factory=placement.PlacementConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    settle_s: float = 3.0
    """Seconds a leader that finds no chain table in the registry (a first start, or a registry restarted
    empty) watches registrations before it assigns or publishes anything: stages that already serve register
    again within a heartbeat or two, and are kept as they serve instead of being planned as they trickle in."""
    rejoin_s: float = 10.0
    """Seconds after --settle-s during which such a leader keeps the range of a stage that serves part of a chain
    whose other stages have not registered again (a slow or cut path to the registry), instead of re-planning
    that chain with spares; once they register, the chain is joined up as it serves."""
    registry: str = "local"
    """'local' hosts the embedded registry in this process; or local://HOST:PORT, consul://HOST:PORT,
    consul+https://HOST:PORT, etcd://HOST:PORT[,HOST:PORT...], etcd+https://HOST:PORT[,HOST:PORT...]."""
    host: str = "127.0.0.1"
    """The address the hosted registry (with --registry local) and the metrics (--metrics-port) serve on."""
    registry_port: int = 50050
    """The hosted registry's port (with --registry local; 0 picks a free port)."""
    tls: str | None = None
    """A directory with ca.pem, scheduler.pem and scheduler-key.pem (`stagemesh certs`; or a role-less mesh.pem): the
    hosted registry serves mutual TLS and the scheduler reaches its registry with it; reloaded on SIGHUP (default:
    plaintext)."""
    plaintext: PlaintextConfig = field(default_factory=PlaintextConfig)
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (default: none): leadership, chains published, stages seen and
    assigned, reconcile time; with --registry local, the hosted registry's too."""
    scheduler_id: str = field(default_factory=lambda: f"scheduler-{uuid.uuid4().hex[:8]}", metadata=NOT_A_FLAG)
    """Names the leader lock's holder: fresh in each process, since two schedulers sharing one would both lead."""

    def __post_init__(self) -> None:
        self.model_name = self.model_name or Path(self.model).name
        if self.dtype not in get_args(DtypeChoice):
            raise ValueError(f"--dtype {self.dtype!r}: use one of {', '.join(get_args(DtypeChoice))}")
        if self.quantize not in ("auto", *QUANTIZE):
            raise ValueError(f"--quantize {self.quantize!r}: use one of auto, {', '.join(QUANTIZE)}")
        if not self.lock_ttl_s > 0:
            raise refused(self, "lock_ttl_s", "must be > 0 seconds (a standby takes over after it)")
        if not self.settle_s >= 0:
            raise refused(self, "settle_s", "must be >= 0 seconds")
        if not self.rejoin_s >= 0:
            raise refused(self, "rejoin_s", "must be >= 0 seconds")
        if not 0 <= self.registry_port <= 65535:
            raise refused(self, "registry_port", PORT_RULE)
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            raise refused(self, "metrics_port", "must be 1..65535")
        self.plaintext.refuse(self.tls, listens=(self.host,) if self.registry == "local" else (),
                              dials=plaintext_hosts(self.registry))


class LeaseLapsing(Exception):
    """The leader could not renew its lock in time: it must stop acting before the lease lapses."""


def host_of(status: ServiceStatus, num_layers: int) -> placement.Host:
    """The host a registration describes; ValueError (saying which value) when its meta is malformed
    or out of range: anyone can write a registration, and one bad one must not stop scheduling."""
    meta = status.record.meta
    fixed = None
    if meta.get("fixed") == "1" and meta.get("layers"):
        fixed = parse_layers(meta["layers"], num_layers)
    try:
        budget = int(meta.get("budget_bytes", ""))
        speed = float(meta.get("speed", "1"))
        tp, devices = int(meta.get("tp", "1")), int(meta.get("devices", "1"))
    except ValueError:
        raise ValueError(f"budget_bytes {meta.get('budget_bytes')!r} / speed {meta.get('speed')!r} / tp "
                         f"{meta.get('tp')!r} / devices {meta.get('devices')!r} are not numbers") from None
    if not (tp >= 1 and devices >= 1):  # tp may pass devices: on a CPU host its ranks share the cores
        raise ValueError(f"tp {tp} and devices {devices} must be >= 1")
    if budget <= 0:
        raise ValueError(f"budget_bytes {budget} must be > 0")
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed {speed} must be finite and > 0")
    serving = parse_layers(meta["layers"], num_layers) if meta.get("ready") == "1" and meta.get("layers") else None
    return placement.Host(host_id=status.record.service_id, memory_bytes=budget, speed=speed, fixed_layers=fixed,
                          fingerprint=meta.get("fingerprint", ""), tp=tp, machine=meta.get("host", ""),
                          devices=devices, serving=serving)


def serves(status: ServiceStatus, start: int, end: int) -> bool:
    """Passing, loaded with exactly this range and serving it."""
    meta = status.record.meta
    return status.passing and meta.get("layers") == f"{start}:{end}" and meta.get("ready") == "1"


class Scheduler:
    def __init__(self, config: SchedulerConfig, registry: Registry, tls: Tls | None = None):
        self.config = config
        self.registry = registry
        model_config = read_config(config.model)
        self.model_args = ModelArgs.from_config(model_config)  # heads: which --tp sizes fit
        self._stored_dtype = serving_dtype("auto", model_config, "cpu")  # the checkpoint's own
        self._footprints: dict[tuple[str, str], ModelFootprint] = {}
        self.footprint = self.footprint_for([])
        self.plan: placement.Plan | None = None
        self.published: list[PublishedChain] | None = None
        self.leading = False
        # The leader lock's holder id is a secret (whoever sends it renews or releases the lock); the registry
        # shows others its digest, holder_name, which is also what this scheduler logs.
        self.holder_id = f"{config.scheduler_id}-{secrets.token_hex(16)}"
        self.assignments = Assignments(registry, self.name)
        self._versions: dict[str, int] = {}  # key -> modify_index of this leader's last write
        self._reported: set[str] = set()  # problems already logged: each once, not once per poll
        self._found: list[placement.ChainPlan] = []  # the chains published when this leader took over
        self._rejoin_until = 0.0  # event-loop time until which serving stages wait for their chains' others
        self._waiting: set[str] = set()  # the stages that waited so at the last reconcile (logged on a change)
        # A probe of lapsed stages: at most a quarter of the lock's TTL, since the leader renews between reconciles.
        self.lapsed = LapsedStages(tls, timeout_s=min(1.0, config.lock_ttl_s / 4))
        self._renewed_at = 0.0  # event-loop time at which the last successful renewal (or the acquire) was asked

    @property
    def name(self) -> str:
        return self.config.model_name

    def sizing(self, services: list[ServiceStatus]) -> tuple[ServingDtype, str]:
        """(dtype, quantize) to size weights at: the flags, or for auto what most live stages announce."""
        announced = Counter((s.record.meta.get("dtype", ""), s.record.meta.get("quantize", "")) for s in services
                            if s.passing and s.record.meta.get("dtype") in get_args(ServingDtype)
                            and s.record.meta.get("quantize", "none") in QUANTIZE)
        dtype, quantize = announced.most_common(1)[0][0] if announced else (self._stored_dtype, "none")
        return (dtype if self.config.dtype == "auto" else self.config.dtype,
                (quantize or "none") if self.config.quantize == "auto" else self.config.quantize)

    def footprint_for(self, services: list[ServiceStatus]) -> ModelFootprint:
        """The model's sizes as the stages hold it (sizing), read from the checkpoint once per sizing."""
        key = self.sizing(services)
        if key not in self._footprints:
            self._footprints[key] = ModelFootprint.from_model_dir(self.config.model, *key)
        return self._footprints[key]

    @property
    def fence(self) -> Fence:
        """What every write of this scheduler is conditioned on: the registry refuses it once this scheduler no
        longer holds the leader lock."""
        return Fence(leader_key(self.name), self.holder_id)

    async def run(self) -> None:
        """Campaigns for the leader lock, leads while it holds it, and campaigns again if it loses it."""
        ttl = self.config.lock_ttl_s
        metrics.announce("scheduler", self.name)
        while True:
            try:
                asked = asyncio.get_running_loop().time()
                if await self.registry.acquire_lock(leader_key(self.name), self.holder_id, ttl):
                    self._renewed_at = asked
                    log.info(f"{self.config.scheduler_id} ({holder_name(self.holder_id)}) leads scheduling of "
                             f"{self.name}")
                    self.leading = True
                    metrics.SCHEDULER_LEADER.set(1)
                    metrics.SCHEDULER_TAKEOVERS.inc()
                    await self._lead()
                    log.warning(f"{self.config.scheduler_id} lost the leader lock; standing by")
            except LeaseLapsing:
                log.warning(f"{self.config.scheduler_id} could not renew the leader lock in time; it stopped "
                            "acting before its lease could lapse, and stands by")
            except LockLost:
                log.warning(f"{self.config.scheduler_id}'s writes were refused by the registry: it no longer holds "
                            "the leader lock (its lease lapsed); it stands by")
            except RegistryError as exc:
                log.warning(f"registry unreachable ({exc}); retrying")
            except Exception as exc:  # a bug or bad data: stand down, log, campaign again (never die)
                self._report(f"scheduling failed ({type(exc).__name__}: {exc}); standing down and retrying",
                             exc_info=True)
            finally:
                self.leading = False
                metrics.SCHEDULER_LEADER.set(0)
                metrics.CHAINS_PUBLISHED.set(0)
            await asyncio.sleep(ttl / 3)

    def _report(self, message: str, exc_info: bool = False) -> None:
        if message not in self._reported:
            self._reported.add(message)
            log.warning(message, exc_info=exc_info)

    async def stop(self) -> None:
        if self.leading:
            with contextlib.suppress(RegistryError):
                await self.registry.release_lock(leader_key(self.name), self.holder_id)
        await self.lapsed.close()

    def _check_lease(self) -> None:
        """Renew-deadline: a leader acts only while its lease surely holds, the last renewal asked less than two
        thirds of the TTL ago; past that a standby may be about to take over, so it writes nothing more."""
        if asyncio.get_running_loop().time() - self._renewed_at >= self.config.lock_ttl_s * 2 / 3:
            raise LeaseLapsing()

    async def _keep_lock(self) -> None:
        """Renews the lock every third of its TTL on its own, whatever a reconcile costs; returns when a renewal
        finds the lock lost."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.lock_ttl_s / 3)
            asked = loop.time()
            if not await self.registry.renew_lock(leader_key(self.name), self.holder_id):
                return
            self._renewed_at = asked

    async def _lead(self) -> None:
        keeper = asyncio.get_running_loop().create_task(self._keep_lock(), name="scheduler-lock")
        try:
            await self._lead_while(keeper)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper  # a renewal's RegistryError surfaces here, to run()

    async def _lead_while(self, keeper: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        ttl = self.config.lock_ttl_s
        # Start from what serves (placement.resume), so a takeover changes nothing that works: the table in the
        # registry, or where the registry restarted empty under this scheduler, the one it published last.
        remembered, self.plan, self.published = self.published or [], None, None
        self._versions = {}
        self.assignments.forget()
        table, _ = await self.registry.kv_get(chains_key(self.name))
        try:
            self._found = [placement.ChainPlan([placement.StagePlan(s.service_id, s.layer_start, s.layer_end)
                                                for s in c.stages], c.fingerprint)
                           for c in (decode_chains(table) if table is not None else remembered)]
        except ValueError:
            self._found = []
        settled = loop.time() + (self.config.settle_s if table is None else 0.0)
        self._rejoin_until = settled + self.config.rejoin_s if table is None else 0.0
        if table is None:
            log.info(f"no chain table in the registry: watching registrations for {self.config.settle_s:g}s "
                     f"before planning, and keeping the ranges stages serve for {self.config.rejoin_s:g}s more "
                     "while the rest of their chains register again")
        indexes = [0, 0]
        while not keeper.done():
            services = await next_change(self.registry, self.name, indexes, ttl / 3)
            if keeper.done():
                return
            if loop.time() >= settled:
                t0 = time.perf_counter()
                await self.reconcile(services)
                metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)

    async def _write(self, key: str, value: bytes) -> bool:
        """Check-and-set against the version this leader last wrote (or read at takeover): a write that
        finds someone else's newer version means another scheduler acts too, so this one stands down."""
        self._check_lease()
        index = self._versions.get(key)
        if index is None:
            _, index = await self.registry.kv_get(key)
        if await self.registry.kv_cas(key, value, index, fence=self.fence):
            _, self._versions[key] = await self.registry.kv_get(key)
            return True
        log.warning(f"{key} was changed by someone else; re-reading before acting again")
        self._versions.pop(key, None)
        self.published = None
        return False

    async def reconcile(self, services: list[ServiceStatus]) -> None:
        """Plans for the live stage servers, tells each its range, and publishes the chains that serve."""
        metrics.STAGES_SEEN.labels("passing").set(sum(s.passing for s in services))
        metrics.STAGES_SEEN.labels("critical").set(sum(not s.passing for s in services))
        services = await self.lapsed.keep_answering(services)
        self.footprint = self.footprint_for(services)
        live, hosts = {}, []
        for s in services:
            if not s.passing:
                continue
            try:
                hosts.append(host_of(s, self.footprint.num_layers))
                live[s.record.service_id] = s
            except ValueError as exc:
                self._report(f"ignoring registration {s.record.service_id}: {exc}")
        previous = placement.resume(self.footprint, hosts, self.plan, self._found)
        # After a registry restarted empty, a stage serving part of a chain whose other stages have not registered
        # again waits for them with its range, instead of its chain being re-split with spares.
        waiting = placement.partial(hosts, previous) if asyncio.get_running_loop().time() < self._rejoin_until else {}
        if waiting and set(waiting) != self._waiting:
            log.info(f"{len(waiting)} stage(s) keep their ranges while their chains' other stages register again: "
                     + ", ".join(f"{sid} ({a}:{b})" for sid, (a, b) in sorted(waiting.items())))
        self._waiting = set(waiting)
        # Off the event loop: planning a fleet from scratch is seconds of CPU (500 stages: 3 s here), and the lock's
        # renewals and the registry's watches must go on meanwhile.
        new_plan = await asyncio.to_thread(placement.plan, self.footprint,
                                           [h for h in hosts if h.host_id not in waiting], self.config.placement,
                                           previous=previous)
        advice = tp_advice.advise(self.footprint, self.model_args, self.config.placement, hosts, new_plan)
        new_plan.explanation += "".join("\n" + line for line in advice)
        if self.plan is None or new_plan.assignments() != self.plan.assignments():
            log.info("plan:\n" + new_plan.explanation)
        self.plan = new_plan

        wanted = new_plan.assignments() | waiting
        metrics.STAGES_SEEN.labels("assigned").set(sum(1 for sid in live if wanted.get(sid)))
        # Read at every reconcile, not once at takeover: whatever is there now (an operator's mistake, a stale
        # leader's write before fencing, a registry restarted empty) is compared with the plan and corrected.
        assigned = await self.assignments.read()
        changed = {}
        for sid, status in live.items():
            if status.record.meta.get("fixed") == "1":
                continue
            rng = wanted.get(sid)
            value = f"{rng[0]}:{rng[1]}" if rng else ""
            if assigned.get(sid) != value:
                changed[sid] = value
        gone = [sid for sid in assigned if sid not in live]
        if changed or gone:
            self._check_lease()
            await self.assignments.write(changed, gone, self.fence)

        by_id = {h.host_id: h for h in hosts}
        ready = [
            PublishedChain(tuple(PublishedStage(s.host_id, live[s.host_id].record.address, s.layer_start,
                                                s.layer_end, by_id[s.host_id].tp, by_id[s.host_id].machine)
                                 for s in chain.stages), fingerprint=chain.fingerprint)
            for chain in new_plan.chains
            if all(serves(live[s.host_id], s.layer_start, s.layer_end) for s in chain.stages)
        ]
        if ready != self.published:
            waiting = len(new_plan.chains) - len(ready)
            summary = (f"{len(ready)} chain(s) published"
                       + (f", {waiting} waiting for their stages to load and serve" if waiting else ""))
            if not await self._write(chains_key(self.name),
                                     encode_chains(ready, f"{new_plan.explanation}\n{summary}")):
                metrics.CHAIN_TABLE_WRITES.labels("conflict").inc()
                return
            metrics.CHAIN_TABLE_WRITES.labels("ok").inc()
            metrics.CHAINS_PUBLISHED.set(len(ready))
            log.info(f"{summary}: " + "; ".join(c.label for c in ready))
            self.published = ready
