"""The chains a router may use: which are healthy, and which one a new request goes to."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh import metrics
from stagemesh.checkpoint import FINGERPRINT_DIGEST_CHARS, fingerprint_digest, fingerprint_protocol
from stagemesh.discovery.chain_table import chain_kind, tp_width
from stagemesh.router.chain_client import Chain, StageEndpoint, background
from stagemesh.tls import Tls
from stagemesh.v1 import stage_pb2, stage_pb2_grpc
from stagemesh.wire import PROTOCOL_VERSION

log = logging.getLogger("stagemesh.router")
STAGE_SERVICE = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name
LATE_CHECKS_TO_DOWN = 2
"""Health checks in a row that get no answer in time before a chain is taken for down (an answer of
NOT_SERVING, or a refused connection, takes it down at once)."""
HOLDS_OF_WITHDRAWN = 64
"""Probe holds kept for chains no table names now (the latest): one published again under its id (the same stages
and ranges) stays held until a probe passes, and the number of ids a router remembers stays bounded."""


SHORT, LONG = "short", "long"


class NoUsableChain(RuntimeError):
    """No chain can take the request now."""


def kind(chain: Chain) -> str:
    return chain_kind([s.tp for s in chain.stages])


def width(chain: Chain) -> int:
    return tp_width([s.tp for s in chain.stages])


def suitability(chain: Chain, length_class: str) -> tuple[int, int]:
    """How well a chain suits prompts of a class, lower first. Short prompts: the fewest ranks, then the
    fewest hops (replicas, then narrow chains): their prefill is small, each hop and all-reduce a cost. Long
    ones: the widest tensor-parallel group, then the most stages (a pipeline overlaps a chunked prefill's
    chunks over its stages)."""
    return (width(chain), len(chain.stages)) if length_class == SHORT else (-width(chain), -len(chain.stages))


def _load(chain: Chain) -> tuple[int, int]:
    """Most room first: fewest streams in flight and steps queued at its busiest stage, then most free KV."""
    return chain.in_flight + chain.queued_steps, -chain.kv_free_bytes


def parse_chain(spec: str, tls: Tls | None = None) -> Chain:
    """'HOST:PORT,HOST:PORT,...' in pipeline order; layer ranges are read from the stages."""
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"--chain {spec!r} names no stage; give HOST:PORT,HOST:PORT,... in pipeline order")
    return Chain([StageEndpoint(a, tls=tls) for a in addresses])


class ChainSet:
    def __init__(self, chains: list[Chain], num_layers: int, model_digest: str,
                 on_change: Callable[[bool], None] | None = None, prefill_chunk: int = 0, tls: Tls | None = None,
                 long_prompt_tokens: int = 0, slots_per_chain: int = 0, panic_threshold: float = 0.0):
        # Length-aware routing: prompts longer than this go to the widest chains first, others to replicas (0: off).
        self.long_prompt_tokens = long_prompt_tokens
        self.slots_per_chain = slots_per_chain  # streams past which a preferred chain counts as full (0: never)
        self.tls = tls  # the channels of chains adopted later (replace()) use it too
        self.chains = chains
        self.num_layers = num_layers
        # The router's own checkpoint's (checkpoint.model_fingerprint): a chain serving another is refused.
        self.model_digest = model_digest[:FINGERPRINT_DIGEST_CHARS]
        # Other builds' digests the operator vouches for (--accept-fingerprints): a rolling weights update.
        self.accepted: frozenset[str] = frozenset()
        self.prefill_chunk = prefill_chunk  # the router's --prefill-chunk, checked against each chain's budget
        self.on_change = on_change
        self.plan = ""
        self._notified = False
        # Chains withdrawn with streams still on them, by id: one published again (a registry flap) is taken
        # back as it is, so its streams keep counting against it and its channels stay open.
        self._withdrawn: dict[str, Chain] = {}
        # A table that would leave fewer than this share of the chains passing their checks now is followed only
        # for the chains it adds (Envoy's panic threshold): see adopt().
        self.panic_threshold = panic_threshold
        self._published: dict[str, object] = {}  # each adopted chain's entry in the table that named it
        # Chains whose end-to-end probe fails (router/chain_probe.py), by id, with why: down, whatever their stages'
        # own checks say, until a probe passes again (hold(), unhold()); kept while a table withdraws the chain
        # (HOLDS_OF_WITHDRAWN).
        self.held: dict[str, str] = {}

    async def adopt(self, published) -> None:
        """Follows a new table (discovery.chain_table.PublishedChain) make-before-break: the chains it adds are
        checked before they replace the ones they succeed, so a re-plan that renames every chain leaves no
        moment without a usable one. A table that drops most of the chains serving now keeps those that still
        pass a check (a scheduler that lost sight of their stages is likelier than most of a fleet dying at once);
        each leaves when its checks fail or a later table drops it alone."""
        known = {c.chain_id for c in self.chains} | set(self._withdrawn)
        fresh = {p.chain_id: self._new_chain(p) for p in published if p.chain_id not in known}
        results = await asyncio.gather(*(self.check(c) for c in fresh.values()))
        for chain, result in zip(fresh.values(), results, strict=True):
            chain.healthy = bool(result) and chain.chain_id not in self.held
            if chain.chain_id in self.held:
                chain.problem = self.held[chain.chain_id]
            elif chain.healthy:
                log.info(f"chain {chain.chain_id} ({chain.label}) is up", extra={"chain": chain.chain_id})
        published = list(published) + await self._kept_in_panic(published, fresh)
        self._published = {p.chain_id: p for p in published}
        if self.replace(published, fresh):
            await self.refresh()
        for chain in fresh.values():  # built for an id the table names twice: never adopted
            for stage in chain.stages:
                background(stage.close())

    async def _kept_in_panic(self, published, fresh: dict[str, Chain]) -> list:
        """The table entries of the serving chains a table drops, where it drops most of them and they still
        pass a check now; none otherwise."""
        wanted = {p.chain_id for p in published}
        serving = [c for c in self.chains if c.healthy]
        dropped = [c for c in serving if c.chain_id not in wanted and c.chain_id in self._published]
        staying = len(serving) - len(dropped) + sum(c.healthy for c in fresh.values())
        if not dropped or staying >= self.panic_threshold * len(serving):
            return []
        passing = [c for c, ok in zip(dropped, await asyncio.gather(*(self.check(c) for c in dropped)), strict=True)
                   if ok is not False]
        if passing:
            metrics.PANIC_TABLES.inc()
            log.warning(f"the published table drops {len(dropped)} of the {len(serving)} chains serving now, leaving "
                        f"{staying}: below the panic threshold ({self.panic_threshold:g}), so the "
                        f"{len(passing)} that pass their checks keep serving: "
                        + ", ".join(c.chain_id for c in passing))
        return [self._published[c.chain_id] for c in passing]

    def _new_chain(self, p) -> Chain:
        return Chain([StageEndpoint(s.address, s.layer_start, s.layer_end, tls=self.tls, tp=s.tp) for s in p.stages],
                     chain_id=p.chain_id, healthy=False, fingerprint=p.fingerprint)  # healthy after its first check

    def replace(self, published, fresh: dict[str, Chain] | None = None) -> bool:
        """Adopts the scheduler's chains (discovery.chain_table.PublishedChain); a chain that stays keeps
        its state and channels; `fresh` holds chains adopt() built (and checked) for new ids. True if
        anything changed."""
        existing = {c.chain_id: c for c in self.chains}
        wanted = [p.chain_id for p in published]
        retyped = False
        for p in published:  # a stage restarted on its address with another --tp keeps the chain's id
            if (known := existing.get(p.chain_id)) is not None:
                for stage, announced in zip(known.stages, p.stages, strict=True):
                    retyped |= stage.tp != announced.tp
                    stage.tp = announced.tp
        if wanted == list(existing):
            return retyped
        wanted_ids = set(wanted)
        new = []
        for p in published:
            chain = existing.get(p.chain_id) or self._withdrawn.pop(p.chain_id, None)
            if chain is not None and chain.withdrawn:
                log.info(f"chain {chain.chain_id} ({chain.label}) published again", extra={"chain": chain.chain_id})
                chain.withdrawn = False
            if chain is None:
                chain = (fresh or {}).pop(p.chain_id, None) or self._new_chain(p)
            new.append(chain)
        gone = [c for c in self.chains if c.chain_id not in wanted_ids]
        self.chains = new
        unnamed = [k for k in self.held if k not in wanted_ids]
        for chain_id in unnamed[:max(0, len(unnamed) - HOLDS_OF_WITHDRAWN)]:
            del self.held[chain_id]
        for chain in gone:
            log.info(f"chain {chain.chain_id} ({chain.label}) withdrawn", extra={"chain": chain.chain_id})
            chain.withdrawn = True
            self._withdrawn[chain.chain_id] = chain
            self._close_if_done(chain)
        self._notify()
        return True

    def release(self, chain: Chain) -> None:
        """A stream left the chain (it had counted itself in chain.in_flight)."""
        chain.in_flight -= 1
        self._close_if_done(chain)

    def _close_if_done(self, chain: Chain) -> None:
        if chain.withdrawn and chain.in_flight == 0:
            self._withdrawn.pop(chain.chain_id, None)
            for stage in chain.stages:
                background(stage.close())

    def usable(self) -> list[Chain]:
        return [c for c in self.chains if c.healthy]

    def preferred(self, length_class: str) -> list[Chain]:
        """The chains that suit this class of prompt best (all of them with the rule off), among all the router
        knows, usable or not: while they are down the class is missing its kind (pick() falls back and counts
        it); once withdrawn from the mesh, the next best kind is the preferred one."""
        if not self.long_prompt_tokens or not self.chains:
            return list(self.chains)
        best = min(suitability(c, length_class) for c in self.chains)
        return [c for c in self.chains if suitability(c, length_class) == best]

    def length_class_of(self, chain: Chain) -> str:
        """Which prompts go to this chain first (ListChains): short, long, any, or "" (only as a fallback)."""
        if not self.long_prompt_tokens:
            return "any"
        classes = [cls for cls in (SHORT, LONG) if any(c is chain for c in self.preferred(cls))]
        return "any" if len(classes) == 2 else "".join(classes)

    def pick(self, exclude: set[str] = frozenset(), prompt_tokens: int | None = None) -> Chain:
        """The healthy chain with the most room (fewest streams in flight and steps queued at its busiest
        stage, then the most free KV memory), among those that suit the prompt's length best (preferred())
        while one of them is neither excluded nor full; among all healthy ones otherwise (a fallback)."""
        candidates = [c for c in self.usable() if c.chain_id not in exclude]
        if not candidates:
            raise NoUsableChain(
                "no usable pipeline chain: every chain has a stage that is down or not serving; "
                "retry later, or check the stage servers (ListChains shows each chain)"
            )
        if not self.long_prompt_tokens or prompt_tokens is None:
            return min(candidates, key=_load)
        length_class = LONG if prompt_tokens > self.long_prompt_tokens else SHORT
        room = [c for c in self.preferred(length_class) if c.healthy and c.chain_id not in exclude
                and not (self.slots_per_chain and c.in_flight >= self.slots_per_chain)]
        metrics.ROUTED.labels(length_class, "preferred" if room else "fallback").inc()
        return min(room or candidates, key=_load)

    def mark_down(self, chain: Chain, why: str) -> None:
        """Takes a chain out (a stream failed on it, its probe fails) and aborts the streams on it, which fail over
        now rather than each at its progress timeout. The next health check that passes brings it back, unless
        it is held (hold())."""
        if chain.healthy:
            log.warning(f"chain {chain.chain_id} ({chain.label}) is down: {why}", extra={"chain": chain.chain_id})
        chain.healthy = False
        chain.marked_down += 1
        if chain.sessions:
            log.warning(f"chain {chain.chain_id}: its {len(chain.sessions)} stream(s) fail over now",
                        extra={"chain": chain.chain_id})
            for session in list(chain.sessions):
                session.abort(why)
        self._notify()

    def hold(self, chain: Chain, why: str) -> None:
        """Down until unhold(): its end-to-end probe failed (router/chain_probe.py), so stages that each pass their
        own check do not bring it back."""
        self.held[chain.chain_id] = why
        chain.problem = why
        self.mark_down(chain, why)

    def unhold(self, chain: Chain) -> None:
        """Its probe passed: the next health check that passes brings it back."""
        if self.held.pop(chain.chain_id, None) is not None:
            log.info(f"chain {chain.chain_id} ({chain.label}) passes its end-to-end probe again",
                     extra={"chain": chain.chain_id})

    def _notify(self) -> None:
        if self.on_change:
            self.on_change(bool(self.usable()))

    async def check(self, chain: Chain, timeout: float = 1.0) -> bool | None:
        """A chain is healthy when every stage answers SERVING, together they cover all layers, and they
        serve one build of the router's own model. Also records the stages' load, which pick() weighs.
        None: a stage did not answer in time, which alone proves nothing (a busy host, a paused event
        loop); refresh() needs it twice."""
        infos = []
        try:
            for stage in chain.stages:
                reply = await health_pb2_grpc.HealthStub(stage.channel).Check(
                    health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=timeout
                )
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    self._problem(chain, f"stage {stage.address} is NOT_SERVING (loading its layers, draining, "
                                         "or waiting for the scheduler to assign it a range)")
                    return False
                infos.append(await stage_pb2_grpc.StageStub(stage.channel).Info(stage_pb2.InfoRequest(),
                                                                               timeout=timeout))
            self._check_identity(chain, infos)
            self._check_layers(chain, infos)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the router stops
            # The chain's channels closed under the call (withdrawn: _close_if_done), which cancels it: no answer.
            return None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            stage = chain.stages[len(infos)]  # the one that did not answer
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                why = f"it does not serve {STAGE_SERVICE} (not a stage server?)"
            else:
                why = f"{exc.code().name}: {exc.details()}"
            # Logged once per stage and code: grpc's details of a dead address vary from one attempt to the next.
            self._problem(chain, f"stage {stage.address}: {why}", key=f"{stage.address} {exc.code().name}")
            return False
        except ValueError as exc:  # a chain that is wrong, not just down: an error
            self._problem(chain, str(exc), logging.ERROR)
            return False
        if chain.problem and chain.chain_id not in self.held:
            log.info(f"chain {chain.chain_id} ({chain.label}) passes its checks again", extra={"chain": chain.chain_id})
            chain.problem = chain.problem_key = ""
        chain.queued_steps = max(i.queued_steps for i in infos)
        chain.kv_free_bytes = min(i.kv_capacity_bytes - i.kv_used_bytes for i in infos)
        chain.step_ms = max(i.step_ms for i in infos)
        chain.pass_ms = sum(i.pass_ms for i in infos)  # a step waits at every stage
        budget = min((i.max_batch_tokens for i in infos if i.max_batch_tokens), default=0)
        if budget != chain.max_batch_tokens:
            chain.max_batch_tokens = budget
            if budget and chain.prefill_chunk(self.prefill_chunk) != self.prefill_chunk:
                log.warning(f"chain {chain.chain_id}: its stages run at most {budget} tokens per pass, so prompts "
                            f"go through it in chunks of {budget}, not --prefill-chunk {self.prefill_chunk}",
                            extra={"chain": chain.chain_id})
        return True

    def _problem(self, chain: Chain, why: str, level: int = logging.WARNING, key: str = "") -> None:
        """Records why chain is unusable (ListChains shows it); logged once per key (default: why), not at
        every check."""
        if (key or why) != chain.problem_key:
            log.log(level, f"chain {chain.chain_id} ({chain.label}) is not usable: {why}",
                    extra={"chain": chain.chain_id})
            chain.problem_key = key or why
        chain.problem = why

    def _check_identity(self, chain: Chain, infos: list[stage_pb2.StageInfo]) -> None:
        """One model, one truth: every stage serves the same build (fingerprint), of the router's model."""
        prints = list(dict.fromkeys(i.fingerprint for i in infos))
        chain.fingerprint = ", ".join(prints)
        if len(prints) > 1:
            raise ValueError(f"chain {chain.label} mixes builds of the model: its stages serve "
                             + ", ".join(f"{s.address} {i.fingerprint or '(none)'}"
                                         for s, i in zip(chain.stages, infos, strict=True)))
        if (digest := fingerprint_digest(prints[0])) != self.model_digest and digest not in self.accepted:
            raise ValueError(f"chain {chain.label} serves model {digest or '(not reported)'}, not this router's "
                             f"{self.model_digest} (the digest of its --model checkpoint) nor one of "
                             "--accept-fingerprints")
        if (version := fingerprint_protocol(prints[0])) != PROTOCOL_VERSION:
            raise ValueError(f"chain {chain.label} speaks stage protocol {version or '(none: an older build)'}, not "
                             f"this router's {PROTOCOL_VERSION}: run its stages and this router from one release")

    def _check_layers(self, chain: Chain, infos: list[stage_pb2.StageInfo]) -> None:
        expect = 0
        for stage, info in zip(chain.stages, infos, strict=True):
            if info.layer_start != expect:
                raise ValueError(
                    f"chain {chain.label}: stage {stage.address} holds layers {info.layer_start}:{info.layer_end} "
                    f"but the chain needs layer {expect} next; list stages in pipeline order"
                )
            stage.layer_start, stage.layer_end = info.layer_start, info.layer_end
            expect = info.layer_end
        if expect != self.num_layers:
            raise ValueError(f"chain {chain.label} covers layers 0:{expect} of {self.num_layers}")

    async def refresh(self) -> None:
        chains = list(self.chains)  # replace() may run while the checks await
        marked = [c.marked_down for c in chains]
        results = await asyncio.gather(*(self.check(c) for c in chains))
        changed = False
        for chain, result, before in zip(chains, results, marked, strict=True):
            if chain.withdrawn:
                self._close_if_done(chain)  # its check may have reopened a channel
                continue
            if chain.marked_down != before:  # a stream failed on it mid-check: what the check saw is older
                continue
            chain.late_checks = chain.late_checks + 1 if result is None else 0
            ok = result if result is not None else chain.healthy and chain.late_checks < LATE_CHECKS_TO_DOWN
            if ok and chain.chain_id in self.held:  # its stages answer, but a step does not get through them
                ok = False
            if ok != chain.healthy:
                log.info(f"chain {chain.chain_id} ({chain.label}) is {'up' if ok else 'down'}",
                         extra={"chain": chain.chain_id})
                chain.healthy = ok
                changed = True
        if changed or not self._notified:
            self._notified = True
            self._notify()

    async def watch(self, interval: float = 1.0) -> None:
        """Checks every chain each interval until cancelled. A round that fails is logged (once per reason) and the
        checks go on: a loop that ended would leave every chain as its last check saw it, for good."""
        failed = ""
        while True:
            try:
                await self.refresh()
                failed = ""
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
                failed = "a call was cancelled under the checks"
                log.warning(f"chain checks: {failed}; checking again")
            except Exception as exc:
                if repr(exc) != failed:
                    log.exception("chain checks failed; checking again")
                failed = repr(exc)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        for chain in self.chains:
            for stage in chain.stages:
                await stage.close()
