"""How a stage's failure reads to the router: the status it raises (naming the stage), and what the end of a
stage call means when grpc's client, not the stage, gave it its status."""

from __future__ import annotations

import grpc


def stage_error(code: grpc.StatusCode, address: str, details: str) -> grpc.aio.AioRpcError:
    """A stage's fault as the router raises it: its status, the details naming the stage."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"stage {address}: {details}")


CALL_BROKE = "Internal error from Core"
"""The details of grpc.aio's own INTERNAL for a call whose write or read failed in the client because the
connection ended under it (a stage stopped while the router was writing to it): the call takes that status
in place of the one the stage's end would have given."""


def call_status(code: grpc.StatusCode, details: str) -> tuple[grpc.StatusCode, str]:
    """A stage call's end as the router reads it: a call that broke under grpc's client (CALL_BROKE) is the
    stage or its link gone, UNAVAILABLE, not INTERNAL, which says a step failed alone on a live stage. So is a
    CANCELLED: a stage never ends a call with it, grpc does, when the server shuts down with the call in flight
    ("Cancelling all calls", or plain "CANCELLED" when the stream's reset comes first; seen under load) — and
    the router's own cancellations never come back as a status."""
    if code == grpc.StatusCode.INTERNAL and details == CALL_BROKE:
        return grpc.StatusCode.UNAVAILABLE, "the call broke: the stage or its link went away"
    if code == grpc.StatusCode.CANCELLED:
        return grpc.StatusCode.UNAVAILABLE, f"the stage cancelled the call ({details}): it is shutting down"
    return code, details
