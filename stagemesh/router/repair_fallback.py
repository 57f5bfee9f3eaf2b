"""Repair's fallbacks to replay, counted by reason (stagemesh_router_repair_fallbacks_total) and logged with the
request's id: a failed stage that could not be repaired costs a whole replay of the prefix on another chain, and an
operator needs to see how often and why (a repair log sized too small for the sessions shows as log_dropped)."""

from __future__ import annotations

import logging

import grpc

from stagemesh import metrics

log = logging.getLogger("stagemesh.router")

REASONS = (
    ("repair is off", "repair_off"),
    ("not the stage's own fault", "not_stage_fault"),
    ("keep no output logs", "not_kept"),
    ("names no stage", "no_stage_named"),
    ("no other stage of this build serves", "no_replacement"),
)
"""repair.possible()'s answers (and Repairs.step's own) by the reason label they count under: a bounded set."""


def reason_of(why: str) -> str:
    """The label of a refusal's text; "other" for one this table does not know yet."""
    return next((label for text, label in REASONS if text in why), "other")


def failed_reason(exc: grpc.aio.AioRpcError) -> str:
    """The label of a repair that was tried and failed: the previous stage's log not there (FAILED_PRECONDITION
    from ReadOutput: dropped for lack of --repair-log-tokens, or never kept), else the repair itself failed."""
    return "log_dropped" if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else "repair_failed"


def fall_back(reason: str, why: str, log_extra: dict[str, str]) -> None:
    """Counts a fallback to replay and logs it once, with the request's fields and the reason as a field."""
    metrics.REPAIR_FALLBACKS.labels(reason).inc()
    log.warning(f"not repairing, replaying instead: {why}", extra={**log_extra, "reason": reason})
