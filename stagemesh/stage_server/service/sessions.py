"""The inference sessions a stage holds: their KV caches, sampling state, idle clocks and openers."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stagemesh.stage_server.engine.kv_pool import KVPool, SessionCache
from stagemesh.stage_server.engine.sampling import TokenHistory
from stagemesh.stage_server.service.forwarding import Route
from stagemesh.stage_server.service.output_log import OutputLog, RepairLog

LOGGED_ID_CHARS = 8
"""How much of a session id logs show: enough to follow a session, never enough to use it (the id is
what lets its opener step it)."""


def short_id(session_id: str) -> str:
    """A session id as logs show it."""
    return session_id[:LOGGED_ID_CHARS]


class SessionError(Exception):
    """Base of the errors a caller can act on; the servicer maps each to a gRPC status."""


class UnknownSession(SessionError):
    pass


class SessionExists(SessionError):
    pass


class SessionTooLong(SessionError):
    pass


@dataclass
class Session:
    session_id: str
    request_id: str
    cache: SessionCache
    owner: str = ""
    """Who opened it (the caller's connection): only they may step or close it."""
    last_used: float = field(default_factory=time.monotonic)
    stepped: bool = False
    """Has had a step: until then, unless a stream holds it (in_use), it expires after the short unstepped timeout."""
    closed: bool = False
    route: Route = field(default_factory=Route)
    """Forwarding: where its output goes, what it was told at open, where its router hears from it."""
    output: OutputLog | None = None
    """Repair: the hidden states it sent on (opened with keep_output, on a stage with a next stage)."""
    history: TokenHistory | None = None
    """Last stage, penalties: its tokens by position (OpenSession's token_history, then each token drawn)."""

    @property
    def in_use(self) -> bool:
        """Stepped, or held by its router's stream (whose end closes it): a session whose first step is still
        on its way (queued behind long prompts on the stages before this one) is in use, not left."""
        return self.stepped or self.route.feed is not None


class SessionTable:
    def __init__(self, pool: KVPool, max_position: int, log_budget: RepairLog | None = None,
                 prefix_cache: bool = False):
        self.pool = pool
        self.prefix_cache = prefix_cache  # sessions opened with prefix_ids attach (and leave) cached blocks
        self.log_budget = log_budget or RepairLog(0, 1, torch.float32)  # the memory of the sessions' output logs
        self.max_position = max_position
        self.sessions: dict[str, Session] = {}
        self.open_attempts = 0  # refused ones too: how hard callers press on this stage
        self.on_close: Callable[[str], None] | None = None
        """Told each session id closed (the links to next stages drop it)."""

    def open(self, session_id: str, max_length: int, request_id: str = "", owner: str = "",
             route: Route | None = None, keep_output: bool = False, prefix_ids: list[int] | None = None,
             prefix_salt: str = "") -> Session:
        """prefix_ids, prefix_salt: what the session starts with (prefix caching, kv_pool.py); the session's
        cache.attached says how many positions came from the cache."""
        self.open_attempts += 1
        if not session_id:
            raise SessionError("session_id is empty; choose a unique id per session")
        if session_id in self.sessions:
            raise SessionExists(f"session {session_id} is already open")
        if not 1 <= max_length <= self.max_position:
            raise SessionTooLong(
                f"max_length {max_length} is outside 1..{self.max_position} (the longest session this stage admits: "
                "the model's context, or its --max-model-len)"
            )
        keys: list[bytes] = []
        if self.prefix_cache and prefix_ids:  # only what the session can reach counts (the rest would cost hashing)
            keys = self.pool.prefix_keys(prefix_ids[: max_length - 1], prefix_salt)
        cache = self.pool.allocate(max_length, keys, prefix_ids)  # raises PoolExhausted
        # A log whose session starts past 0 (positions attached) drops itself at its first step: no next stage
        # can be rebuilt from it; one rewound to 0 at its first step (the chain's other stages had less) logs all.
        # --repair-log-tokens 0: no log, and nothing said per session (the operator chose it).
        output = (OutputLog(self.log_budget, {"session_id": short_id(session_id), "request_id": request_id})
                  if keep_output and self.log_budget.capacity_tokens else None)
        session = Session(session_id, request_id, cache, owner, route=route or Route(), output=output)
        self.sessions[session_id] = session
        return session

    def get(self, session_id: str, owner: str = "") -> Session:
        """The session, for a step by owner. Another caller's session is as unknown to it as one that
        never existed: the answer must not tell a prober that the id is in use."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise UnknownSession(
                f"no open session {session_id!r} on this stage (never opened, closed, or expired)"
            )
        session.last_used = time.monotonic()
        session.stepped = True
        return session

    def relayed(self, session_id: str, key: str) -> Session:
        """The session, for a step relayed by the previous stage: only with the session's upstream_key
        (a session opened without one takes no relayed step), else as unknown as one never opened."""
        session = self.sessions.get(session_id)
        upstream_key = session.route.upstream_key if session is not None else ""
        if not upstream_key or not hmac.compare_digest(upstream_key.encode(), key.encode()):
            raise UnknownSession(
                f"no open session {session_id!r} on this stage takes relayed steps with that key"
            )
        session.last_used = time.monotonic()
        session.stepped = True
        return session

    def close(self, session_id: str, owner: str | None = None) -> bool:
        """Frees the session; owner None is the stage itself (stream end, expiry, slice swap). False:
        no such session, or not owner's."""
        session = self.sessions.get(session_id)
        if session is None or (owner is not None and session.owner != owner):
            return False
        del self.sessions[session_id]
        session.closed = True
        session.route.stepped.set()
        self.pool.release(session.cache)
        if session.output is not None:
            session.output.drop()
        if self.on_close is not None:
            self.on_close(session_id)
        return True

    def expire_idle(self, timeout_s: float, unstepped_timeout_s: float | None = None) -> list[str]:
        """Closes sessions idle for timeout_s, and those opened and left (never stepped, no stream holding them)
        for unstepped_timeout_s: opening sessions without using them must not hold the pool for the long idle
        timeout."""
        now = time.monotonic()
        short = timeout_s if unstepped_timeout_s is None else min(timeout_s, unstepped_timeout_s)
        idle = [sid for sid, s in self.sessions.items() if now - s.last_used > (timeout_s if s.in_use else short)]
        for sid in idle:
            self.close(sid)
        return idle

    def __len__(self) -> int:
        return len(self.sessions)
