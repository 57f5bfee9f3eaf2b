"""`stagemesh bench --target URL`: load on a running router, over gRPC against a real mesh on loopback, and over
the OpenAI-compatible HTTP wire shape; its arrival times, workload and figures at unit level."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from stagemesh import cli
from stagemesh.bench import BenchConfig, measure
from stagemesh.bench_report import LATENCIES, PERCENTILES, Slo, aggregate, percentile
from stagemesh.bench_targets import Outcome
from stagemesh.bench_workload import LengthDist, Workload, poisson_gaps
from stagemesh.config_flags import from_args
from tests.conftest import splits, start_mesh
from tests.harness.fault_mesh import free_port

ROOT = Path(__file__).resolve().parent.parent
RUN_S = 240
"""A bench subprocess's bound: a few seconds alone on 2 idle cores, room for a machine many times slower."""
FIGURES = {"duration_s", "completed", "failed", "errors", "total_input_tokens", "total_output_tokens",
           "request_throughput", "output_throughput", "goodput", *(f"{name}_ms" for name in LATENCIES)}


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`stagemesh bench` as a user runs it: a process of its own."""
    return subprocess.run([sys.executable, "-m", "stagemesh.cli", "--log-level", "warning", "bench", "--no-progress",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S,
                          env={**os.environ, **(env or {})})


def check_report(report: dict, completed: int, output_tokens: int) -> None:
    assert FIGURES <= report.keys()
    assert (report["completed"], report["failed"], report["errors"]) == (completed, 0, {})
    assert report["total_output_tokens"] == output_tokens
    assert len(report["requests"]) == completed
    for name in LATENCIES:
        row = report[f"{name}_ms"]
        assert set(row) == {"mean", *(f"p{p}" for p in PERCENTILES)}
        assert 0 < row["p50"] <= row["p90"] <= row["p99"]
    assert report["request_throughput"] == pytest.approx(completed / report["duration_s"])
    assert all(r["ttft_s"] <= r["e2e_s"] for r in report["requests"])


# ---- units --------------------------------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_rate_asked_for():
    gaps = [g for g, _ in zip(poisson_gaps(4.0, random.Random(3)), range(20000), strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: the stddev is the mean
    again = [g for g, _ in zip(poisson_gaps(4.0, random.Random(3)), range(20000), strict=False)]
    assert again == gaps


def test_lengths_parse_draw_within_bounds_and_refuse_nonsense():
    rng = random.Random(1)
    assert LengthDist.parse("32") == LengthDist.parse("fixed:32") == LengthDist("fixed", 32)
    assert {LengthDist.parse("uniform:4:6").draw(rng) for _ in range(200)} == {4, 5, 6}
    normal = [LengthDist.parse("normal:100:10").draw(rng) for _ in range(4000)]
    assert statistics.fmean(normal) == pytest.approx(100, rel=0.02) and min(normal) >= 1
    assert str(LengthDist.parse("normal:100:10")) == "normal:100:10"
    for bad in ("0", "x", "uniform:5", "uniform:6:4", "normal:10:-1", "zipf:3:4"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_synthetic_prompts_are_vocabulary_ids_without_eos_else_words():
    dist = LengthDist.parse("uniform:20:40")
    ids = Workload(dist, LengthDist.parse("7"), seed=5, vocab_size=6, eos_token_ids=(1,))
    made = [ids.request(i) for i in range(50)]
    assert all(20 <= len(r.prompt) <= 40 and r.input_len == len(r.prompt) and r.max_tokens == 7 for r in made)
    assert {t for r in made for t in r.prompt} == {0, 2, 3, 4, 5}
    assert Workload(dist, LengthDist.parse("7"), seed=5, vocab_size=6, eos_token_ids=(1,)).request(49) == made[49]
    words = Workload(dist, LengthDist.parse("7"), seed=5).request(0)
    assert isinstance(words.prompt, str) and 20 <= len(words.prompt.split()) <= 40 and words.input_len is None


def test_figures_goodput_and_errors_from_outcomes():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile(range(101), 99) == 99 and percentile([7], 90) == 7
    fast = Outcome(4, 5, ttft_s=0.01, e2e_s=0.05, output_tokens=5, itl_s=[0.01] * 4)
    slow = Outcome(4, 5, ttft_s=0.5, e2e_s=0.9, output_tokens=5, itl_s=[0.1] * 4)
    failed = Outcome(4, 5, error="UNAVAILABLE", e2e_s=0.2)
    assert fast.tpot_s == pytest.approx(0.01) and failed.tpot_s is None
    figures = aggregate([fast, slow, failed], 2.0, Slo(ttft_ms=100))
    assert (figures["completed"], figures["failed"], figures["errors"]) == (2, 1, {"UNAVAILABLE": 1})
    assert figures["goodput"] == {"slo_ms": {"ttft_ms": 100}, "good": 1, "fraction": pytest.approx(1 / 3),
                                  "rate": 0.5}
    assert figures["total_input_tokens"] == 8 and figures["output_throughput"] == 5.0
    assert figures["ttft_ms"]["mean"] == pytest.approx(255) and figures["itl_ms"]["p50"] == pytest.approx(55)
    assert aggregate([fast], 1.0, Slo())["goodput"] is None


def test_settings_refuse_what_cannot_run_and_lengths_come_from_the_environment(monkeypatch):
    for bad, flag in (({"target": "tcp://h:1", "num_requests": 1}, "--target"),
                      ({"target": "grpc://h", "num_requests": 1}, "--target"),
                      ({"target": "grpc://h:1", "num_requests": 1, "request_rate": -1}, "--request-rate"),
                      ({"target": "grpc://h:1"}, "--num-requests")):
        with pytest.raises(ValueError, match=flag):
            BenchConfig(**bad)
    monkeypatch.setenv("STAGEMESH_OUTPUT_LEN", "normal:9:2")
    config = from_args(BenchConfig, cli.parse(["bench", "--target", "http://h:1/v1", "--duration-s", "5"]))
    assert config.output_len == LengthDist("normal", 9, 2) and config.input_len == LengthDist("fixed", 32)
    assert BenchConfig(target="grpc://h:1", num_requests=1, input_len=12).input_len == LengthDist("fixed", 12)


def test_bench_needs_no_torch():
    probe = "import sys, stagemesh.bench; print(sorted({'torch', 'transformers', 'matplotlib'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_router_it_cannot_reach_stops_it_before_any_load():
    for target in ("grpc://127.0.0.1:1", "http://127.0.0.1:1"):  # nothing listens on port 1
        done = bench("--target", target, "--num-requests", "1")
        assert done.returncode == 2 and done.stderr.startswith("stagemesh bench: "), (target, done.stderr)


# ---- gRPC: a real mesh --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def mesh(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router_options={"http_port": free_port()})
    yield mesh
    await mesh.stop()


async def test_bench_over_grpc_counts_every_request_and_token_and_writes_json_and_png(mesh, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = await asyncio.to_thread(
        bench, "--target", f"grpc://{mesh.router.address}", "--concurrency", "2", "--num-requests", "6",
        "--warmup", "1", "--input-len", "8", "--output-len", "5", "--slo-ttft-ms", "60000", "--json-out", str(out),
        "--plot-out", str(png))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    check_report(report, completed=6, output_tokens=6 * 5)
    assert all(r["output_tokens"] == 5 and len(r["itl_s"]) >= 1 for r in report["requests"])
    assert report["goodput"]["good"] == 6 and report["settings"]["output_len"] == "5"
    assert "token" not in report["settings"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in done.stdout and "completed requests      6" in done.stdout


async def test_bench_counts_refused_requests_by_status(mesh, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7], "max_tokens": 3}\n{"prompt": [5, 1000], "max_tokens": 3}\n')
    config = BenchConfig(target=f"grpc://{mesh.router.address}", dataset=str(prompts), num_requests=4, warmup=0,
                         concurrency=2, progress=False)
    report, outcomes = await measure(config)
    assert (report["completed"], report["failed"], report["errors"]) == (2, 2, {"INVALID_ARGUMENT": 2})  # vocab 1000
    assert report["total_input_tokens"] == 6 and report["total_output_tokens"] == 6


# ---- HTTP: OpenAI's wire shape ------------------------------------------------------------------------------------

def openai_stand_in(received: list[dict]) -> FastAPI:
    """Any OpenAI-compatible server the bench may be pointed at (another engine's, a gateway): it speaks OpenAI's
    streamed completions exactly (completion chunks as server-sent events, usage last, `data: [DONE]`), one token a
    chunk, records what it was sent, and refuses or fails where told, which the router's own front (benched above)
    cannot be made to do on cue. Not a model: each token's text is " t"."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": "stagemesh"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        received.append({"authorization": request.headers.get("authorization"), **body})
        if body["prompt"] == "refuse me":
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                           "code": "429"}}, status_code=429)
        n = body["max_tokens"]

        def chunk(text: str, reason: str | None, usage: dict | None = None) -> str:
            choices = [] if usage else [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
            data = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                    "choices": choices, "usage": usage}
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            if body["prompt"] == "fail midway":
                yield chunk(" t", None)
                error = {"message": "lost a stage", "type": "server_error", "param": None, "code": 503}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            for i in range(n):
                await asyncio.sleep(0.002)
                yield chunk(" t", "length" if i == n - 1 else None)
            yield chunk("", None, {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.asynccontextmanager
async def stand_in(received: list[dict] | None = None) -> AsyncIterator[str]:
    """The stand-in served by uvicorn in this event loop on a free port: its base URL."""
    app = openai_stand_in([] if received is None else received)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture(scope="module")
def http_router(mesh) -> str:
    """The base URL of the mesh's router's OpenAI-compatible HTTP front."""
    return mesh.router.http.url


async def test_bench_over_http_counts_every_request_and_token(http_router, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon a time", "max_tokens": 4}\n{"prompt": [5, 6, 7], "max_tokens": 3}\n')
    out = tmp_path / "bench.json"
    done = await asyncio.to_thread(bench, "--target", http_router, "--dataset", str(prompts), "--concurrency", "2",
                                   "--num-requests", "6", "--json-out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    check_report(report, completed=6, output_tokens=3 * 4 + 3 * 3)
    assert sorted(r["output_tokens"] for r in report["requests"]) == [3, 3, 3, 4, 4, 4]


async def test_bench_sends_openais_streamed_completion_and_counts_refusals(tmp_path, monkeypatch):
    """What goes on the wire, seen by the stand-in: the model /v1/models named, the prompt as text or token ids,
    streaming with usage, the caller's token ($STAGEMESH_TOKEN, as stagemesh.client reads it), ignore_eos and
    min_tokens; a 429, and an error object mid-stream, are counted by their status."""
    received: list[dict] = []
    async with stand_in(received) as url:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": [5, 6], "max_tokens": 2}\n{"prompt": "refuse me", "max_tokens": 2}\n'
                           '{"prompt": "fail midway", "max_tokens": 2}\n')
        monkeypatch.setenv("STAGEMESH_TOKEN", "secret-1")
        report, _ = await measure(BenchConfig(target=url + "/v1", dataset=str(prompts), num_requests=6, warmup=0,
                                              concurrency=1, progress=False))
    assert (report["completed"], report["failed"]) == (2, 4)
    assert report["errors"] == {"HTTP 429": 2, "HTTP 503": 2}  # refused at once, and failed mid-stream
    assert report["total_input_tokens"] == 6 and report["model"] == "stand-in"  # from its usage, its /v1/models
    first = received[0]
    assert first == {"authorization": "Bearer secret-1", "model": "stand-in", "prompt": [5, 6], "max_tokens": 2,
                     "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                     "ignore_eos": True, "min_tokens": 2}
    assert received[1]["prompt"] == "refuse me" and len(received) == 6


async def test_poisson_arrivals_send_exactly_the_requests_bounded(tmp_path):
    """At a rate far above what is served, the run still sends --num-requests and no more, at rising times."""
    received: list[dict] = []
    async with stand_in(received) as url:
        report, outcomes = await measure(BenchConfig(target=url, request_rate=500.0, num_requests=12, warmup=2,
                                                     output_len=LengthDist.parse("2"), progress=False))
    assert len(received) == 12 + 2 and report["completed"] == 12 and report["total_output_tokens"] == 24
    sent = sorted(o.sent_s for o in outcomes)
    assert sent[0] < sent[-1]
