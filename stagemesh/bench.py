"""`stagemesh bench --target URL`: load on a running router, gRPC or its OpenAI-compatible HTTP port, from any
machine (it needs neither torch nor transformers). Requests arrive in a Poisson process at --request-rate, or from
--concurrency callers each sending its next request when its last one ends; the first --warmup requests are not
counted. What each request saw is aggregated in stagemesh/bench_report.py; what is sent comes from
stagemesh/bench_workload.py; the two fronts are called by stagemesh/bench_targets.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tqdm import tqdm

from stagemesh.bench_report import Slo, aggregate, check_plotting, plot, table
from stagemesh.bench_targets import GrpcTarget, HttpTarget, Outcome, Sampling
from stagemesh.bench_workload import BenchRequest, LengthDist, Workload, poisson_gaps
from stagemesh.config_flags import METAVAR, TYPE, refused

log = logging.getLogger("stagemesh.bench")
MAX_IN_FLIGHT = 256
"""Requests in flight at most with --request-rate and no --concurrency (each gRPC one holds a thread)."""
SCHEMES = ("grpc", "http", "https")
LENGTH = {TYPE: LengthDist.parse, METAVAR: "DIST"}


@dataclass
class BenchConfig:
    """`stagemesh bench`: load on a running router, with per-request latencies, throughput and goodput."""

    target: str
    """The router: grpc://HOST:PORT (its gRPC port; TLS with --ca), http://HOST:PORT or https://HOST:PORT (its
    OpenAI-compatible HTTP port, POST /v1/completions streamed)."""
    input_len: LengthDist = field(default=LengthDist("fixed", 32), metadata=LENGTH)
    """Prompt length of synthetic requests: N, uniform:LOW:HIGH or normal:MEAN:STDDEV. In tokens where the router
    tells its vocabulary (gRPC GetModelInfo): random token ids; else in words of English text."""
    output_len: LengthDist = field(default=LengthDist("fixed", 32), metadata=LENGTH)
    """New tokens each request asks for (max_tokens), drawn as --input-len is."""
    dataset: str | None = None
    """A JSONL file of prompts instead, one {"prompt": text or [token ids], "max_tokens": N} a line (max_tokens
    optional: else --output-len), sent in order, again from the start when they run out."""
    request_rate: float = 0.0
    """Requests per second, arriving as a Poisson process (0: a closed loop of --concurrency callers)."""
    concurrency: int = 0
    """With --request-rate: the most requests in flight, later arrivals waiting (0: 256). Without it: the number of
    callers, each sending its next request when its last one ends (0: 1)."""
    num_requests: int = 0
    """Stop sending after this many counted requests (0: no bound; give this or --duration-s, or both)."""
    duration_s: float = 0.0
    """Stop sending after this many seconds (0: no bound); requests in flight then still finish and count."""
    warmup: int = 1
    """Requests sent first, at the same concurrency, and not counted."""
    seed: int = 0
    """Seeds the workload's lengths, prompts and arrival times: the same seed sends the same requests."""
    temperature: float = 0.0
    """Sampling temperature of every request (0: greedy)."""
    ignore_eos: bool = True
    """Ask for exactly max_tokens new tokens (ignore_eos, and min_tokens = max_tokens) where the server supports
    it; --no-ignore-eos lets the model's end-of-sequence token end a request early."""
    slo_ttft_ms: float | None = None
    """Goodput: a good request's time to first token is at most this (ms)."""
    slo_tpot_ms: float | None = None
    """Goodput: a good request's time per output token after the first is at most this (ms)."""
    slo_e2e_ms: float | None = None
    """Goodput: a good request's whole latency is at most this (ms)."""
    json_out: str | None = None
    """Write the settings, the aggregates and every request's timings here as JSON."""
    plot_out: str | None = None
    """Write a PNG of the latency distributions here (needs matplotlib, an optional dependency)."""
    model: str = ""
    """HTTP: the model name sent (default: the first that GET /v1/models lists)."""
    token: str | None = None
    """A caller token of the router's --auth-tokens file (default: $STAGEMESH_TOKEN)."""
    ca: str | None = None
    """A PEM file of the CA that signed the router's certificate: gRPC over TLS, or https:// with a private CA."""
    cert: str | None = None
    """This caller's certificate (PEM), where the router asks for one (with --key)."""
    key: str | None = None
    """The private key of --cert (PEM)."""
    timeout_s: float = 300.0
    """A request still unfinished after this long fails (counted as a timeout)."""
    progress: bool = True
    """A progress bar on stderr while it runs (--no-progress: none)."""

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):  # a config file may give a bare number
            if not isinstance(getattr(self, name), LengthDist):
                setattr(self, name, LengthDist.parse(str(getattr(self, name))))
        url = urlsplit(self.target)
        if url.scheme not in SCHEMES or not url.hostname or not url.port:
            raise refused(self, "target", "use grpc://HOST:PORT, http://HOST:PORT or https://HOST:PORT")
        for name in ("request_rate", "concurrency", "num_requests", "duration_s", "warmup"):
            if getattr(self, name) < 0:
                raise refused(self, name, "must be >= 0")
        if not (self.num_requests or self.duration_s):
            raise ValueError("give --num-requests N or --duration-s S (or both): when to stop sending")
        if self.timeout_s <= 0:
            raise refused(self, "timeout_s", "must be > 0")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise refused(self, name, "must be > 0 ms")
        if bool(self.cert) != bool(self.key):
            raise ValueError("--cert and --key go together")

    @property
    def in_flight(self) -> int:
        """Requests in flight at most."""
        return self.concurrency or (MAX_IN_FLIGHT if self.request_rate else 1)

    @property
    def slo(self) -> Slo:
        return Slo(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_e2e_ms)

    def settings(self) -> dict:
        """The settings as --json-out records them (never the token)."""
        return {k: str(v) if isinstance(v, LengthDist) else v for k, v in dataclasses.asdict(self).items()
                if k != "token"}


def open_target(config: BenchConfig) -> GrpcTarget | HttpTarget:
    url = urlsplit(config.target)
    sampling = Sampling(config.temperature, config.ignore_eos)
    access = {"token": config.token, "ca": config.ca, "cert": config.cert, "key": config.key,
              "timeout_s": config.timeout_s}
    if url.scheme == "grpc":
        return GrpcTarget(url.netloc, sampling, threads=config.in_flight, **access)
    base = f"{url.scheme}://{url.netloc}{url.path.rstrip('/').removesuffix('/v1')}"  # OpenAI's base_url ends /v1
    return HttpTarget(base, sampling, model=config.model, **access)


class Run:
    """The measured requests: which one is next, whether to send more, and what each one saw."""

    def __init__(self, config: BenchConfig, target: GrpcTarget | HttpTarget, workload: Workload, progress: tqdm):
        self.config, self.target, self.workload, self.progress = config, target, workload, progress
        self.sent = 0
        self.outcomes: list[Outcome] = []
        self.start = time.perf_counter()

    def take(self) -> BenchRequest | None:
        """The next request to send, counted as sent now; None once the run is to send no more."""
        c = self.config
        if (c.num_requests and self.sent >= c.num_requests) or (
                c.duration_s and time.perf_counter() - self.start >= c.duration_s):
            return None
        self.sent += 1
        return self.workload.request(c.warmup + self.sent - 1)

    async def send(self, request: BenchRequest) -> None:
        sent_s = time.perf_counter() - self.start
        outcome = await self.target.send(request)
        outcome.sent_s = sent_s
        self.outcomes.append(outcome)
        self.progress.update(1)

    async def closed_loop(self, callers: int) -> None:
        async def caller() -> None:
            while (request := self.take()) is not None:
                await self.send(request)

        await asyncio.gather(*(caller() for _ in range(callers)))

    async def poisson(self, rate: float, cap: int, rng: random.Random) -> None:
        """Sends at the arrival times of a Poisson process; an arrival while `cap` are in flight waits for one."""
        gate, tasks = asyncio.Semaphore(cap), set()

        async def send(request: BenchRequest) -> None:
            try:
                await self.send(request)
            finally:
                gate.release()

        due = time.perf_counter()
        for gap in poisson_gaps(rate, rng):
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await gate.acquire()
            if (request := self.take()) is None:
                gate.release()
                break
            task = asyncio.create_task(send(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            due += gap
        await asyncio.gather(*tasks)


async def warm_up(config: BenchConfig, target: GrpcTarget | HttpTarget, workload: Workload) -> None:
    gate = asyncio.Semaphore(config.in_flight)

    async def one(i: int) -> Outcome:
        async with gate:
            return await target.send(workload.request(i))

    outcomes = await asyncio.gather(*(one(i) for i in range(config.warmup)))
    if failed := [o.error for o in outcomes if o.error]:
        log.warning(f"{len(failed)} of {config.warmup} warm-up requests failed: {', '.join(sorted(set(failed)))}")


async def measure(config: BenchConfig) -> tuple[dict, list[Outcome]]:
    """Runs the benchmark: its report, as --json-out writes it, and what each counted request saw."""
    target = open_target(config)
    try:
        info = await target.describe()
        workload = Workload(config.input_len, config.output_len, config.seed, dataset=config.dataset,
                            vocab_size=info.vocab_size if info else 0, eos_token_ids=info.eos_token_ids if info else ())
        if workload.prompt_unit == "words":
            log.info("prompts are English words: the target tells no vocabulary size (gRPC GetModelInfo)")
        await warm_up(config, target, workload)
        with tqdm(total=config.num_requests or None, unit="req", file=sys.stderr, disable=not config.progress,
                  desc="bench") as progress:
            run = Run(config, target, workload, progress)
            if config.request_rate:
                await run.poisson(config.request_rate, config.in_flight, random.Random(f"arrivals {config.seed}"))
            else:
                await run.closed_loop(config.in_flight)
            duration_s = time.perf_counter() - run.start
    finally:
        await target.close()
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "client_host": platform.node(),
            "settings": config.settings(), "model": info.model if info else None,
            "prompt_unit": workload.prompt_unit, **aggregate(run.outcomes, duration_s, config.slo),
            "requests": [{**dataclasses.asdict(o), "tpot_s": o.tpot_s} for o in run.outcomes]}, run.outcomes


def run_bench(config: BenchConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    if config.plot_out:
        check_plotting()  # before the run, not after it
    report, outcomes = asyncio.run(measure(config))
    load = f"{config.request_rate:g} req/s Poisson" if config.request_rate else f"concurrency {config.in_flight}"
    print(f"stagemesh bench: {config.target}, {load}, prompts in {report['prompt_unit']}\n{table(report)}")
    if config.json_out:
        with open(config.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if config.plot_out:
        plot(outcomes, config.plot_out, f"{config.target}, {load}")
