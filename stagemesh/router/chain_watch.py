"""Keeps a router's chains equal to what the scheduler publishes, and keeps the last known chains
serving while the registry cannot be reached."""

from __future__ import annotations

import asyncio
import logging

from stagemesh.discovery.chain_table import decode_chains, published_plan
from stagemesh.discovery.registry import Registry, RegistryError, chains_key
from stagemesh.router.chains import ChainSet

log = logging.getLogger("stagemesh.router")


async def follow_chains(registry: Registry, model_name: str, chains: ChainSet) -> None:
    """Runs until cancelled, whatever the registry holds: a malformed table is logged (once) and
    skipped, and the chains known before it keep serving."""
    index = 0
    unreachable = False
    rejected = b""
    missing = False
    while True:
        try:
            index, entry = await registry.watch_key(chains_key(model_name), index, timeout_s=30)
            raw = entry.value if entry else None
            if raw is None and chains.chains:  # a registry restarted empty: its scheduler has not planned yet
                if not missing:
                    log.warning(f"the registry holds no chain table (restarted?); serving on the last known "
                                f"{len(chains.chains)} chain(s) until a scheduler publishes one")
                    missing = True
                continue
            missing = False
            try:
                published = decode_chains(raw)
            except ValueError as exc:
                if raw != rejected:
                    log.warning(f"ignoring the published chains: {exc}; serving on the last known "
                                f"{len(chains.chains)} chain(s)")
                    rejected = raw or b""
                continue
            chains.plan = published_plan(raw) or ""
            await chains.adopt(published)
            if unreachable:
                log.info("registry reachable again")
                unreachable = False
        except RegistryError as exc:
            if not unreachable:
                log.warning(f"registry unreachable ({exc}); serving on the last known "
                            f"{len(chains.chains)} chain(s)")
                unreachable = True
            await asyncio.sleep(1.0)
        except Exception:  # a bug must not stop the router from following the scheduler
            log.exception("following the published chains failed; retrying")
            await asyncio.sleep(1.0)
