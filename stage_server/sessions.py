"""The inference sessions a stage holds: their KV caches, sampling state and idle clocks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from stage_server.kv_pool import KVPool, SessionCache


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
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False


class SessionTable:
    def __init__(self, pool: KVPool, max_position: int):
        self.pool = pool
        self.max_position = max_position
        self.sessions: dict[str, Session] = {}
        self.open_attempts = 0  # refused ones too: how hard callers press on this stage

    def open(self, session_id: str, max_length: int, request_id: str = "") -> Session:
        self.open_attempts += 1
        if not session_id:
            raise SessionError("session_id is empty; choose a unique id per session")
        if session_id in self.sessions:
            raise SessionExists(f"session {session_id} is already open")
        if not 1 <= max_length <= self.max_position:
            raise SessionTooLong(
                f"max_length {max_length} is outside 1..{self.max_position} (the model's context)"
            )
        cache = self.pool.allocate(max_length)  # raises PoolExhausted
        session = Session(session_id, request_id, cache)
        self.sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(
                f"no open session {session_id!r} on this stage (never opened, closed, or expired)"
            )
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        self.pool.release(session.cache)
        return True

    def expire_idle(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        idle = [sid for sid, s in self.sessions.items() if now - s.last_used > timeout_s]
        for sid in idle:
            self.close(sid)
        return idle

    def __len__(self) -> int:
        return len(self.sessions)
