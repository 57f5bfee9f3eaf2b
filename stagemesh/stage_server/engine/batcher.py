"""Continuous batching: steps of many sessions that are waiting together run as one forward pass.

Handlers submit steps and await their results; one task drains the queue into batches (decode
steps first, then prefill chunks up to a token budget, so a long prefill never holds decodes
back for long) and runs each batch on the stage's single compute thread. Steps that arrive
while a batch runs join the next one: sessions enter and leave the running batch freely.
A batch of one short decode step runs on the event loop itself: the hop to the compute thread
and back would cost more than the step saves by leaving the loop free. A stage before the last of its chain runs
its decode steps in groups (BatcherConfig.decode_groups), so that the chain's stages work on different groups at
once instead of taking turns on one.

One request cannot cost another its step: a pass that fails is run again one step at a time, so
only the step that fails alone fails (its KV positions are rewritten on the retry, and a session's
length moves only when its pass succeeds), and sampling errors stay with their step. A step left
out of a pass for lack of budget gains priority until it runs. Stopping the batcher fails every
step it holds, the one in flight included, so no caller waits forever.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from stagemesh import metrics
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.stage_server.cpu.compute_thread import set_own_threads
from stagemesh.stage_server.engine.kv_pool import PREEMPTED, PoolExhausted, Preempted
from stagemesh.stage_server.engine.model import StageModel, StepSlice
from stagemesh.stage_server.engine.sampling import Logprobs, Sampling, sample_rows
from stagemesh.stage_server.engine.step_timing import StepTiming
from stagemesh.stage_server.service.sessions import Session, UnknownSession

AGED_AFTER_PASSES = 2
"""A step left out of this many passes runs in the next one, first (alone if it is over the budget)."""


def inline_allowed(device_type: str, compute_threads: int) -> bool:
    """Whether a lone short pass may run inline on the event loop: only on a CPU whose compute thread runs torch
    on one thread (the event loop's is held to one, compute_thread.py, and would run a wider pass narrower). Never
    on a GPU: the pass ends in a wait for its tokens' copy back to the host, which on the loop would hold every
    other session's messages, in and out, for the pass's length."""
    return device_type == "cpu" and compute_threads == 1


class BatcherStopped(RuntimeError):
    """The stage stopped or is swapping its slice: the step did not run; another chain can take it."""


class StepFailed(RuntimeError):
    """This step failed alone (retried apart from the rest of its pass); others were not affected."""


class OutOfMemory(RuntimeError):
    """The device ran out of memory for this step; it did not run."""


@dataclass
class StepRequest:
    session: Session
    start: int
    inputs: torch.Tensor  # [n] token ids on the first stage, [n, hidden] elsewhere
    sampling: Sampling | None = None  # last stage: None means no sample (a prefill chunk)
    return_logits: bool = False
    future: asyncio.Future | None = field(default=None, repr=False)
    passes_skipped: int = 0  # passes it was left out of for lack of budget

    @property
    def length(self) -> int:
        return self.inputs.shape[0]


@dataclass
class StepResult:
    hidden: torch.Tensor | None = None  # [n, hidden]
    token_id: int | None = None
    logits: torch.Tensor | None = None  # [vocab]
    logprobs: Logprobs | None = None  # when the sampling asked for them


class StepBatcher:
    def __init__(self, model: StageModel, config: BatcherConfig, executor: ThreadPoolExecutor,
                 warm_step_ms: float = 0.0, full_pass_ms: float = 0.0, open_sessions: Callable[[], int] | None = None,
                 compute_threads: int | None = None):
        """executor: the stage's one compute thread (StageServer.compute), running torch on compute_threads (None:
        as many as this thread). open_sessions: how many sessions the stage holds, which sizes a group of decode
        steps (BatcherConfig.decode_groups); None: no groups."""
        self.model = model
        self.device = model.device
        self.config = config
        self.max_tokens = config.pass_tokens(model.device.type)  # a pass's budget (--max-batch-tokens)
        self.queue: deque[StepRequest] = deque()
        self.wakeup = asyncio.Event()
        self.executor = executor
        self.open_sessions = open_sessions
        self.base_threads = compute_threads or torch.get_num_threads()
        self.may_inline = inline_allowed(model.device.type, self.base_threads)
        self.recent_decode_ms: deque[float] = deque(maxlen=64)
        self.recent_pass_ms: deque[float] = deque(maxlen=64)  # every kind of pass
        self.warm_step_ms, self.full_pass_ms = warm_step_ms, full_pass_ms
        self.batches_run = 0
        self.timing = StepTiming()  # where step time goes (stage_service times the wire side)
        self.running: list[StepRequest] = []  # the pass in flight
        self.last_progress = time.monotonic()  # when a pass last finished (or the batcher went idle)
        self.stopped = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_forever(), name="step-batcher")

    async def stop(self) -> None:
        """Fails every step it holds, queued or in flight, and every later submit."""
        self.stopped = True
        if self._task:
            self._task.cancel()
        for req in [*self.running, *self.queue]:
            if req.future and not req.future.done():
                req.future.set_exception(BatcherStopped("the stage stopped serving this slice mid-step"))
        self.queue.clear()
        self.running = []

    async def submit(self, req: StepRequest) -> StepResult:
        if self.stopped:
            raise BatcherStopped("the stage is not serving this slice any more")
        req.future = asyncio.get_running_loop().create_future()
        if not self.queue and not self.running:
            self.last_progress = time.monotonic()  # idle until now: the stall clock starts here
        self.queue.append(req)
        self.wakeup.set()
        return await req.future

    def can_run_now(self) -> bool:
        """Whether a lone decode step may skip the queue (run_now): nothing queued or running, and a lone short
        decode step would run inline, on the event loop, anyway."""
        return not self.stopped and not self.queue and not self.running and self._short_decodes()

    def run_now(self, req: StepRequest) -> StepResult:
        """A lone decode step run on the caller's stack, where can_run_now() holds: the pass the batcher would
        run for it, without the queue, the future and the loop turns (stage_service: a stage serving one
        session has nothing to batch it with)."""
        t0 = time.perf_counter()
        self.running = [req]
        try:
            (result,) = self._run_isolated([req])
        finally:
            self.running = []
        self._passed([req], time.perf_counter() - t0)
        if isinstance(result, Exception):
            raise result
        return result

    def stalled_for(self) -> float:
        """Seconds the batcher has had work without finishing a pass (0 when idle or moving)."""
        if not self.queue and not self.running:
            return 0.0
        return time.monotonic() - self.last_progress

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def step_ms(self) -> float:
        """The median of the last 64 decode passes (before any: the warm-up's)."""
        return statistics.median(self.recent_decode_ms) if self.recent_decode_ms else self.warm_step_ms

    @property
    def pass_ms(self) -> float:
        """How long a step may wait behind one pass (a prefill chunk's takes many decode steps' time): the
        longest of the last 64, or the warm-up's estimate of a full one (--max-batch-tokens) if that is longer,
        so that a fresh stage's first long pass is expected too."""
        return max(max(self.recent_pass_ms, default=0.0), self.full_pass_ms)

    def _take_batch(self) -> list[StepRequest]:
        """Aged steps first (oldest first), then decode steps up to a group (oldest first), then prefill chunks,
        within the budget."""
        aged = [r for r in self.queue if r.passes_skipped >= AGED_AFTER_PASSES]
        decode = [r for r in self.queue if r.length == 1 and r.passes_skipped < AGED_AFTER_PASSES]
        prefill = [r for r in self.queue if r.length > 1 and r.passes_skipped < AGED_AFTER_PASSES]
        batch, tokens, seen = [], 0, set()
        decode_room = self._decode_group()
        for r in aged + decode + prefill:
            if r.session.session_id in seen:
                continue  # one step per session per pass: the next starts where this one ends
            if r.length == 1 and r.passes_skipped < AGED_AFTER_PASSES:
                if decode_room == 0:
                    continue  # the next group: the next pass takes it first (not aged: the queue keeps its order)
                decode_room -= 1
            if batch and tokens + r.length > self.max_tokens:
                r.passes_skipped += 1
                continue
            batch.append(r)
            seen.add(r.session.session_id)
            tokens += r.length
        taken = {id(r) for r in batch}
        self.queue = deque(r for r in self.queue if id(r) not in taken)
        return batch

    def _decode_group(self) -> int:
        """How many decode steps this pass may take (BatcherConfig.decode_groups): on a stage before the last, a
        group's share of the open sessions; else all (-1)."""
        groups = self.config.decode_groups
        if self.model.is_last or groups <= 1 or self.open_sessions is None:
            return -1
        return max(self.config.decode_group_min_rows, -(-self.open_sessions() // groups))

    async def _run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            if self.config.batch_window_ms > 0:
                await asyncio.sleep(self.config.batch_window_ms / 1000)
            self.wakeup.clear()
            while self.queue:
                # One turn of the loop first: steps that arrive together (a Relay stream's next messages,
                # read one at a time) join this pass instead of each running alone, inline, ahead of them.
                await asyncio.sleep(0)
                batch = [r for r in self._take_batch() if not r.future.done()]
                if not batch:
                    continue
                t0 = time.perf_counter()
                self.running = batch
                try:
                    if self._inline(batch):
                        results = self._run_isolated(batch)
                    else:
                        results = await loop.run_in_executor(self.executor, self._on_compute, batch)
                finally:
                    self.running = []
                self._passed(batch, time.perf_counter() - t0)
                for req, res in zip(batch, results, strict=True):
                    if req.future.done():
                        continue
                    if isinstance(res, Exception):
                        req.future.set_exception(res)
                    else:
                        req.future.set_result(res)

    def _passed(self, batch: list[StepRequest], took: float) -> None:
        """A pass's bookkeeping: progress, metrics, the recent pass times."""
        self.last_progress = time.monotonic()
        metrics.PASS_SECONDS.labels(metrics.batch_label(len(batch))).observe(took)
        metrics.PASS_TOKENS.observe(sum(r.length for r in batch))
        self.recent_pass_ms.append(took * 1000)
        if all(r.length == 1 for r in batch):
            self.recent_decode_ms.append(took * 1000)
        self.batches_run += 1

    def _inline(self, batch: list[StepRequest]) -> bool:
        """A lone decode step of a stage whose decode passes are known to be short."""
        return len(batch) == 1 and batch[0].length == 1 and self._short_decodes()

    def _short_decodes(self) -> bool:
        """Whether the last decode pass was short enough to run inline (and inline torch work is allowed)."""
        return self.may_inline and bool(self.recent_decode_ms) and self.recent_decode_ms[-1] < self.config.inline_max_ms

    def pass_threads(self, batch: list[StepRequest]) -> int:
        """The torch threads of a pass on the compute thread: --lone-session-threads for the decode step of a stage
        that serves one session (its chain's other stages wait for it, their cores idle), else --threads."""
        lone = self.config.lone_session_threads
        if lone and len(batch) == 1 and batch[0].length == 1 and self.open_sessions and self.open_sessions() == 1:
            return lone
        return self.base_threads

    def _on_compute(self, batch: list[StepRequest]) -> list[StepResult | Exception]:
        """_run_isolated on the compute thread, on the pass's threads."""
        threads = self.pass_threads(batch)
        if threads != torch.get_num_threads():  # this thread's count, as the pass's kernels will read it
            set_own_threads(threads)
        return self._run_isolated(batch)

    def _run_isolated(self, batch: list[StepRequest]) -> list[StepResult | Exception]:
        """Runs the pass; if it fails, runs its steps one by one so that only a failing step fails.
        Runs on the compute thread (or, for a lone short decode step, on the event loop)."""
        with batch[0].session.cache.pool.reading(req.session.cache for req in batch):
            try:
                return self._run_batch(batch)
            except Exception as exc:
                if len(batch) == 1:
                    return [self._failed(batch[0], exc)]
            results: list[StepResult | Exception] = []
            for req in batch:
                try:
                    results.extend(self._run_batch([req]))
                except Exception as exc:
                    results.append(self._failed(req, exc))
            return results

    @staticmethod
    def _failed(req: StepRequest, exc: Exception) -> Exception:
        """The step did not happen: its session stays where it was."""
        if not req.session.closed:
            cache = req.session.cache
            try:  # the blocks it took for this step go back; what it wrote past start is written again
                cache.pool.rewind(cache, min(cache.length, req.start))
            except PoolExhausted:  # no room to copy a shared block it would write again: it is preempted
                pass
        return _step_error(exc)

    def _run_batch(self, batch: list[StepRequest]) -> list[StepResult | Exception]:
        """One forward pass over the batch's live steps; sampling errors stay with their step."""
        results: dict[int, StepResult | Exception] = {}
        for req in batch:
            if req.session.closed:
                results[id(req)] = UnknownSession(f"session {req.session.session_id} closed mid-step")
        self._grow(batch, results)
        live = [r for r in batch if id(r) not in results]
        if live:
            t0 = time.perf_counter()
            steps, offset = [], 0
            for req in live:
                steps.append(StepSlice(req.session.cache, offset, req.start, req.length))
                offset += req.length
            inputs = live[0].inputs if len(live) == 1 else torch.cat([r.inputs for r in live])
            inputs = inputs.to(self.device)
            decode = offset == len(live)  # a pass of decode steps only (step_timing counts those apart)
            t0 = self.timing.since("assemble", t0, decode)
            out = self.model(inputs, steps)
            if self.model.is_last:
                t0 = self.timing.since("model", t0, decode)
                positions = [req.start + req.length for req in live]
                tokens = sample_rows(out, [req.sampling for req in live], positions,
                                     [req.session.history for req in live])
                wanted = [i for i, req in enumerate(live) if req.return_logits]
                logits = dict(zip(wanted, out[wanted].cpu(), strict=True)) if wanted else {}
                for i, req in enumerate(live):
                    token = tokens[i]
                    results[id(req)] = (
                        _step_error(token) if isinstance(token, Exception)
                        else StepResult(token_id=None if token is None else token.token, logits=logits.get(i),
                                        logprobs=None if token is None else token.logprobs))
                self.timing.since("sample", t0, decode)
            else:
                on_device, out = out, out.cpu()
                self.timing.since("model", t0, decode)
                for req, st in zip(live, steps, strict=True):
                    results[id(req)] = StepResult(hidden=out[st.offset : st.offset + st.length])
                    if req.session.output is not None:  # repair's log: copied here, in the pass's stream order
                        rows = on_device if req.session.output.budget.device.type == on_device.device.type else out
                        req.session.output.append(req.start, rows[st.offset : st.offset + st.length])
        return [results[id(r)] for r in batch]

    @staticmethod
    def _grow(batch: list[StepRequest], results: dict[int, StepResult | Exception]) -> None:
        """Gives each step's session the KV blocks of its new positions, in batch order; a session the pool
        preempts to make room (the newest first, kv_pool.py) fails its step here with Preempted."""
        by_cache = {id(req.session.cache): req for req in batch}
        for req in batch:
            if id(req) in results:
                continue
            cache = req.session.cache
            try:
                victims = cache.pool.grow(cache, req.start + req.length)
            except PoolExhausted as exc:
                results[id(req)] = exc
                continue
            for victim in victims:
                other = by_cache.get(id(victim))
                if other is not None:
                    results[id(other)] = Preempted(PREEMPTED)


def _step_error(exc: Exception) -> Exception:
    """What a failed step reports: out of memory as such; anything else as this step's own failure
    (the exception chained, for the stage's log)."""
    if isinstance(exc, (UnknownSession, BatcherStopped, StepFailed, OutOfMemory, PoolExhausted)):
        return exc
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        failure: Exception = OutOfMemory(f"the device ran out of memory for this step: {exc}")
    else:
        failure = StepFailed(f"{type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure
