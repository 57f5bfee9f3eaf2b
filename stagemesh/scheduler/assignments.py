"""The stages' assignments in the registry as the leader keeps them: read at every reconcile and compared with the
plan, so a write the leader did not make (an operator's mistake, a stale leader's, a registry restarted empty) is
corrected; written fenced by the leader lock, so a leader whose lease lapsed writes nothing."""

from __future__ import annotations

import asyncio
import logging

from stagemesh.discovery.registry import Fence, Registry, ServiceStatus, assignment_key, assignments_prefix

log = logging.getLogger("stagemesh.scheduler")


class Assignments:
    def __init__(self, registry: Registry, model: str):
        self.registry = registry
        self.model = model
        self.current: dict[str, str] = {}  # service id -> "A:B" ("" for a spare), as the registry held at read()
        self._wrote: dict[str, str] = {}  # what this leader last wrote to each: anything else there is drift

    def forget(self) -> None:
        """At a takeover: what an earlier leadership wrote proves nothing about the registry now."""
        self._wrote = {}

    async def read(self) -> dict[str, str]:
        """The assignments in the registry now; a value other than this leader's last write is logged (and, as it
        differs from the plan, rewritten by the caller)."""
        entries = await self.registry.kv_list(assignments_prefix(self.model))
        self.current = {e.key.rsplit("/", 1)[1]: e.value.decode("utf-8", errors="replace") for e in entries}
        for sid, value in self.current.items():
            if sid in self._wrote and self._wrote[sid] != value:
                log.warning(f"the assignment of {sid} was changed behind the leader's back (to {value!r}; it wrote "
                            f"{self._wrote[sid]!r}): correcting it to the plan")
        return self.current

    async def write(self, changed: dict[str, str], gone: list[str], fence: Fence) -> None:
        """Writes changed and deletes gone, concurrently (at fleet size one write after another would hold the plan
        back for seconds), each fenced: LockLost if this scheduler no longer leads."""
        await asyncio.gather(*(self.registry.kv_put(assignment_key(self.model, sid), v.encode(), fence=fence)
                               for sid, v in changed.items()),
                             *(self.registry.kv_delete(assignment_key(self.model, sid), fence=fence)
                               for sid in gone))
        for sid, value in changed.items():
            self.current[sid] = self._wrote[sid] = value
            log.info(f"assigned layers {value or '(none: spare)'} to {sid}")
        for sid in gone:
            self.current.pop(sid, None)
            self._wrote.pop(sid, None)


async def next_change(registry: Registry, model: str, indexes: list[int], timeout_s: float) -> list[ServiceStatus]:
    """The registrations once they or the assignments changed, or after timeout_s; indexes holds both watches'
    indexes and moves on. A leader wakes on either: a registration to plan for, an assignment to correct."""
    watches = [asyncio.ensure_future(registry.watch_services(indexes[0], timeout_s, model=model)),
               asyncio.ensure_future(registry.watch_prefix(assignments_prefix(model), indexes[1], timeout_s))]
    try:
        await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watch in watches:
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
    results = [w.result() if w.done() and not w.cancelled() else None for w in watches]
    for i, result in enumerate(results):
        if result is not None:
            indexes[i] = result[0]
    return results[0][1] if results[0] is not None else await registry.services(model)
