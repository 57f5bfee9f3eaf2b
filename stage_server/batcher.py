"""Continuous batching: steps of many sessions that are waiting together run as one forward pass.

Handlers submit steps and await their results; one task drains the queue into batches (decode
steps first, then prefill chunks up to a token budget, so a long prefill never holds decodes
back for long) and runs each batch on the stage's single compute thread. Steps that arrive
while a batch runs join the next one: sessions enter and leave the running batch freely.
A batch of one short decode step runs on the event loop itself: the hop to the compute thread
and back would cost more than the step saves by leaving the loop free.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from stage_server.model import StageModel, StepSlice
from stage_server.sampling import Sampling, sample
from stage_server.sessions import Session, UnknownSession
from stagemesh.config_flags import refused


@dataclass
class StepRequest:
    session: Session
    start: int
    inputs: torch.Tensor  # [n] token ids on the first stage, [n, hidden] elsewhere
    sampling: Sampling | None = None  # last stage: None means no sample (a prefill chunk)
    return_logits: bool = False
    future: asyncio.Future | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return self.inputs.shape[0]


@dataclass
class StepResult:
    hidden: torch.Tensor | None = None  # [n, hidden]
    token_id: int | None = None
    logits: torch.Tensor | None = None  # [vocab]


@dataclass
class BatcherConfig:
    batch_window_ms: float = 0.0
    """Wait this long for more steps after the first arrives, to batch them together (0: take what is queued)."""
    max_batch_tokens: int = 2048
    """Token budget of one forward pass; one step larger than it still runs, alone."""
    inline_max_ms: float = 5.0
    """A lone decode step runs on the event loop while the last decode pass took less than this (0: never);
    above it the hop to the compute thread costs less than holding the loop."""

    def __post_init__(self) -> None:
        if not self.batch_window_ms >= 0:
            raise refused(self, "batch_window_ms", "must be >= 0 milliseconds (0: no waiting, take what is queued)")
        if not self.max_batch_tokens >= 1:
            raise refused(self, "max_batch_tokens", "must be >= 1 token (a pass of 2048 is ordinary)")
        if not self.inline_max_ms >= 0:
            raise refused(self, "inline_max_ms", "must be >= 0 milliseconds (0: every pass on the compute thread)")


class StepBatcher:
    def __init__(self, model: StageModel, config: BatcherConfig):
        self.model = model
        self.device = model.device
        self.config = config
        self.queue: deque[StepRequest] = deque()
        self.wakeup = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.recent_decode_ms: deque[float] = deque(maxlen=64)
        self.batches_run = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_forever(), name="step-batcher")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for req in self.queue:
            if req.future and not req.future.done():
                req.future.set_exception(asyncio.CancelledError())
        self.queue.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, req: StepRequest) -> StepResult:
        req.future = asyncio.get_running_loop().create_future()
        self.queue.append(req)
        self.wakeup.set()
        return await req.future

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def step_ms(self) -> float:
        return statistics.median(self.recent_decode_ms) if self.recent_decode_ms else 0.0

    def _take_batch(self) -> list[StepRequest]:
        decode = [r for r in self.queue if r.length == 1]
        prefill = [r for r in self.queue if r.length > 1]
        batch, tokens, seen = [], 0, set()
        for r in decode + prefill:
            if r.session.session_id in seen:
                continue  # one step per session per pass: the next starts where this one ends
            if batch and tokens + r.length > self.config.max_batch_tokens:
                continue
            batch.append(r)
            seen.add(r.session.session_id)
            tokens += r.length
        taken = {id(r) for r in batch}
        self.queue = deque(r for r in self.queue if id(r) not in taken)
        return batch

    async def _run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            if self.config.batch_window_ms > 0:
                await asyncio.sleep(self.config.batch_window_ms / 1000)
            self.wakeup.clear()
            while self.queue:
                batch = [r for r in self._take_batch() if not r.future.done()]
                if not batch:
                    continue
                t0 = time.perf_counter()
                try:
                    if self._inline(batch):
                        results = self._run_batch(batch)
                    else:
                        results = await loop.run_in_executor(self.executor, self._run_batch, batch)
                except Exception as exc:  # a bug in the pass: fail its steps, keep serving others
                    results = [exc] * len(batch)
                if all(r.length == 1 for r in batch):
                    self.recent_decode_ms.append((time.perf_counter() - t0) * 1000)
                self.batches_run += 1
                for req, res in zip(batch, results, strict=True):
                    if req.future.done():
                        continue
                    if isinstance(res, Exception):
                        req.future.set_exception(res)
                    else:
                        req.future.set_result(res)

    def _inline(self, batch: list[StepRequest]) -> bool:
        """A lone decode step of a stage whose decode passes are known to be short."""
        return (len(batch) == 1 and batch[0].length == 1 and bool(self.recent_decode_ms)
                and self.recent_decode_ms[-1] < self.config.inline_max_ms)

    def _run_batch(self, batch: list[StepRequest]) -> list[StepResult | Exception]:
        """Runs on the compute thread (or, for a lone short decode step, on the event loop)."""
        live: list[StepRequest] = []
        results: dict[int, StepResult | Exception] = {}
        for req in batch:
            if req.session.closed:
                results[id(req)] = UnknownSession(f"session {req.session.session_id} closed mid-step")
            else:
                live.append(req)
        if live:
            steps, offset = [], 0
            for req in live:
                steps.append(StepSlice(req.session.cache, offset, req.start, req.length))
                offset += req.length
            inputs = live[0].inputs if len(live) == 1 else torch.cat([r.inputs for r in live])
            out = self.model(inputs.to(self.device), steps)
            if self.model.is_last:
                for i, req in enumerate(live):
                    res = StepResult()
                    if req.sampling is not None:
                        if req.session.generator is None and not req.sampling.greedy:
                            req.session.generator = torch.Generator().manual_seed(req.sampling.seed)
                        res.token_id = sample(out[i].cpu(), req.sampling, req.session.generator)
                    if req.return_logits:
                        res.logits = out[i].cpu()
                    results[id(req)] = res
            else:
                out = out.cpu()
                for req, st in zip(live, steps, strict=True):
                    results[id(req)] = StepResult(hidden=out[st.offset : st.offset + st.length])
        return [results[id(r)] for r in batch]
