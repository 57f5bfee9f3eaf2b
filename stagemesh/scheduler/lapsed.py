"""Which stages whose registration lapsed still serve: the scheduler asks each itself before planning without it.

A lapsed registration says the stage stopped heartbeating to the registry, not that it stopped serving: a partition
between stages and the registry, a slow agent or a paused registry lapses every stage at once while every chain
still serves. So a lapsed stage that answers SERVING to the scheduler's own health check keeps its place (planned as
it last was while passing); one that does not answer is planned without at once (a dead stage's range goes to a
spare).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh import grpc_server, metrics
from stagemesh.discovery.registry import ServiceStatus
from stagemesh.tls import Tls
from stagemesh.v1 import stage_pb2

log = logging.getLogger("stagemesh.scheduler")

STAGE_SERVICE = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name


class LapsedStages:
    def __init__(self, tls: Tls | None, timeout_s: float):
        self.tls = tls  # how the scheduler reaches a stage (the mesh's mutual TLS, or plaintext)
        self.timeout_s = timeout_s  # how long a lapsed stage has to answer
        self._last_passing: dict[str, ServiceStatus] = {}  # each stage's last passing registration
        self._channels: dict[str, grpc.aio.Channel] = {}  # to each lapsed stage's address
        self._kept: list[str] = []  # the lapsed stages kept at the last look (sorted ids)

    async def keep_answering(self, services: list[ServiceStatus]) -> list[ServiceStatus]:
        """The registrations as the plan sees them: each lapsed (or vanished) one that answers, as it last was
        while passing."""
        current = {s.record.service_id: s for s in services}
        for s in services:
            if s.passing:
                self._last_passing[s.record.service_id] = s
        lapsed = [last for sid, last in self._last_passing.items()
                  if not (sid in current and current[sid].passing)]
        answers = await asyncio.gather(*(self._serving(s.record.address) for s in lapsed))
        kept = [last for last, answered in zip(lapsed, answers, strict=True) if answered]
        for last, answered in zip(lapsed, answers, strict=True):
            if not answered:
                del self._last_passing[last.record.service_id]
                if (channel := self._channels.pop(last.record.address, None)) is not None:
                    await channel.close()
                log.warning(f"stage {last.record.service_id}'s registration lapsed and it does not answer: "
                            "planning without it")
        kept_ids = sorted(s.record.service_id for s in kept)
        if kept_ids != self._kept:  # said when the set changes, not at every reconcile
            self._kept = kept_ids
            if kept_ids:
                log.warning(f"{len(kept_ids)} stage(s) whose registration lapsed answer their health checks and "
                            f"keep their place: {', '.join(kept_ids[:10])}{' ...' if len(kept_ids) > 10 else ''}")
        metrics.STAGES_SEEN.labels("lapsed").set(len(kept))
        kept_set = set(kept_ids)
        return [s for s in services if s.record.service_id not in kept_set] + kept

    async def _serving(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc_server.channel(address, self.tls)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
