"""A request's session on a chain whose stages forward to each other: the router sends token ids to
the first stage and reads the sampled tokens from the last; hidden states go stage to stage without it
(N + 1 one-way trips per token instead of 2N, and no hidden state decoded or encoded here).

Every stage's Forward stream is still the session's lifeline there, and where that stage reports the
session's fault: the first stage's carries the steps, the others a `follow`. Whichever stream ends
first with a fault ends the step with that stage's status, so the router's failure semantics (which
stage, which code) are those of relay mode."""

from __future__ import annotations

import asyncio
import secrets
import time

import grpc

from router.chain_client import ChainSession, Sampling, stage_error
from stagemesh import metrics, tensor_codec
from stagemesh.v1 import stage_pb2


class ForwardingSession(ChainSession):
    """ChainSession for chains of two or more stages that forward (GenerationConfig.forwarding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # hop_keys[i]: what stage i-1 presents to stage i with each relayed step (128 random bits per hop,
        # never logged): only the stage the router chose may step stage i's session.
        self.hop_keys = ["", *(secrets.token_hex(16) for _ in self.chain.stages[1:])]
        self._fault: int | None = None  # the stage whose stream ended first, unasked

    def _open_request(self, index: int) -> stage_pb2.OpenSessionRequest:
        request = super()._open_request(index)
        request.upstream_key = self.hop_keys[index]
        if index:
            request.previous_address = self.chain.stages[index - 1].address
        if index < len(self.chain.stages) - 1:
            request.next_address = self.chain.stages[index + 1].address
            request.next_key = self.hop_keys[index + 1]
        return request

    async def _open_streams(self) -> None:
        await super()._open_streams()
        for index, call in enumerate(self._streams):
            call.add_done_callback(lambda done, i=index: self._stream_ended(i, done))
        follow = stage_pb2.ForwardRequest(session_id=self.session_id, follow=True)
        limit = self.progress.timeout(self.chain, 1)
        index = 0  # the stage being told to follow
        try:
            async with asyncio.timeout(limit):
                while index < len(self._streams) - 1:
                    index += 1
                    await self._streams[index].write(follow)
        except TimeoutError:
            raise stage_error(grpc.StatusCode.UNAVAILABLE, self.chain.stages[index],
                               f"no progress on a follow in {limit:.1f}s: hung or unreachable") from None
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):  # it ended already: its status says why
            await self._raise_fault(index)

    def _stream_ended(self, index: int, call: grpc.aio.StreamStreamCall) -> None:
        """A stage's stream ended: unless the router ended it, that is the session's fault there. The step
        waiting on the last stage is woken (its read is cancelled) to report it."""
        if self._fault is not None or not self._streams:
            return
        self._fault = index
        if index != len(self._streams) - 1:
            self._streams[-1].cancel()

    async def _raise_fault(self, index: int) -> None:
        """Raises stage index's status (its stream has ended)."""
        call = self._streams[index]
        code, details = await call.code(), await call.details()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNAVAILABLE, "ended the stream"
        raise stage_error(code, self.chain.stages[index], details)

    async def _step(self, token_ids: list[int], sampling: Sampling, chunk_size: int,
                    return_logits: bool) -> stage_pb2.ForwardResponse:
        first, last = self._streams[0], self._streams[-1]
        size = chunk_size if chunk_size and len(token_ids) > chunk_size else len(token_ids)
        start = self.position
        limit = self.progress.timeout(self.chain, len(token_ids))
        at = 0  # the stage whose stream is being written or read
        try:
            async with asyncio.timeout(limit):  # one timer for the step (no task per write or read, as wait_for)
                # Every chunk at once: the first stage computes chunk k + 1 while the next computes chunk k.
                for k in range(0, len(token_ids), size):
                    request = stage_pb2.ForwardRequest(session_id=self.session_id, start=start + k,
                                                       token_ids=tensor_codec.encode_ids(token_ids[k: k + size]))
                    if k + size >= len(token_ids):
                        request.return_logits = return_logits
                        if sampling != self.sampling:
                            request.sampling.CopyFrom(sampling.to_pb())
                    else:
                        request.skip_sample = True
                    await first.write(request)
                if self._token_read_at is not None:
                    metrics.TOKEN_TURNAROUND.observe(time.perf_counter() - self._token_read_at)
                    self._token_read_at = None
                at = len(self._streams) - 1
                response = await last.read()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):  # a stream had ended: its status says why
            self._fault = at if self._fault is None else self._fault
            response = grpc.aio.EOF
        except asyncio.CancelledError:
            if self._fault is None or asyncio.current_task().cancelling():
                raise
            response = grpc.aio.EOF
        except TimeoutError:
            metrics.STEP_TIMEOUTS.inc()
            labels = ", ".join(s.address for s in self.chain.stages)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                details=f"chain {labels}: no token in {limit:.1f}s for a {len(token_ids)}-token step: "
                        "a stage on the way is hung, or a link is cut") from None
        if self._fault is not None:
            await self._raise_fault(self._fault)
        if response is grpc.aio.EOF:
            await self._raise_fault(len(self._streams) - 1)
        self._answered.update((0, len(self._streams) - 1))  # both hold the session on the stream: it closes there
        return response


def session_class(forwarding: bool, stages: int) -> type[ChainSession]:
    """The session for a chain of `stages`: forwarding needs two or more (one stage answers itself)."""
    return ForwardingSession if forwarding and stages > 1 else ChainSession
