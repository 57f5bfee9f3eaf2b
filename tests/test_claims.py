"""Claims of the README and the protos, each held to a test: how a stream ends (stop string, EOS,
length), priority aging, the call's deadline while queued, failover of any stage (and mid-prefill), a
stage that comes back, and sliding-window / tied-embedding checkpoints against transformers."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import grpc
import prometheus_client
import pytest
import torch

from stagemesh.router.generation import GenerationConfig
from stagemesh.router.priority_queue import AdmissionConfig, ClassLimits, PriorityAdmission
from stagemesh.stage_server.config import BatcherConfig, StageConfig
from stagemesh.stage_server.server import StageServer
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import router_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh, stepped_logits, until
from tests.test_exactness import prompt
from tests.test_traffic import request

# 1. How a stream ends -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"])


async def test_a_stop_string_ends_the_stream_before_it_with_finish_reason_stop(tiny_model, hf_models, tokenizer):
    """A stop string that the greedy text contains (here across two tokens): the stream ends with
    FINISH_REASON_STOP before the token that completed it (not returned, issue 47: token_ids and text end at the
    same place), its text is everything before the stop string (the stop string itself is cut, as
    router/detokenizer.py releases text), and nothing follows."""
    ids = tokenizer("The quick brown fox")["input_ids"]
    greedy = hf_greedy(hf_models["llama"], ids, 40)
    full = tokenizer.decode(greedy, skip_special_tokens=True)
    # A stop string that straddles the boundary between tokens 8 and 9 of the greedy text.
    boundary = len(tokenizer.decode(greedy[:9], skip_special_tokens=True))
    stop = full[boundary - 2 : boundary + 3]
    assert len(stop) == 5 and stop.strip(), f"greedy text {full!r} has no usable stop string at {boundary}"
    cut = full.find(stop)
    ends_at = next(k for k in range(1, len(greedy) + 1) if stop in tokenizer.decode(greedy[:k]))
    assert ends_at < len(greedy)  # without the stop string the stream would go on

    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        got, text, responses = await collect(mesh.router_stub.Generate(
            request(ids, 40, stop=["never appears \u2603", stop]), timeout=60))
    finally:
        await mesh.stop()
    assert got == greedy[:ends_at - 1]  # neither the token that completed the stop string nor any after it
    assert cut < len(tokenizer.decode(greedy[:ends_at - 1], skip_special_tokens=True))  # it began in a returned one
    assert text == full[:cut] and stop not in text
    assert responses[-1].usage.completion_tokens == ends_at - 1
    assert responses[-1].finish_reason == router_pb2.FINISH_REASON_STOP
    assert all(r.finish_reason == router_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


async def test_max_new_tokens_ends_the_stream_with_finish_reason_length(tiny_model, hf_models, tokenizer):
    """Without stop or EOS, exactly max_new_tokens tokens come, the last message says LENGTH, and the
    text (nothing held back for a stop string that cannot complete any more) is their whole decoding."""
    ids = prompt(12, seed=31)
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        got, text, responses = await collect(mesh.router_stub.Generate(
            request(ids, 7, stop=["zzzzzz"]), timeout=60))
    finally:
        await mesh.stop()
    assert got == hf_greedy(hf_models["llama"], ids, 7)
    assert text == tokenizer.decode(got, skip_special_tokens=True)
    assert responses[-1].finish_reason == router_pb2.FINISH_REASON_LENGTH
    assert all(r.finish_reason == router_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


async def test_an_eos_token_from_generation_config_ends_the_stream_like_transformers(
        tiny_models, hf_models, tokenizer, tmp_path):
    """A checkpoint whose generation_config.json names, besides </s>, a token that the greedy run
    produces: the stream stops on it with FINISH_REASON_EOS, exactly where transformers' generate()
    stops, and its text is that of the tokens before it."""
    from transformers import AutoModelForCausalLM

    ids = tokenizer("The quick brown fox")["input_ids"]
    greedy = hf_greedy(hf_models["llama"], ids, 30)
    at = next(i for i in range(3, len(greedy)) if greedy[i] not in greedy[:i])  # first seen at position `at`
    model = tmp_path / "llama-eos"
    shutil.copytree(tiny_models["llama"], model)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [tokenizer.eos_token_id, greedy[at]]
    (model / "generation_config.json").write_text(json.dumps(generation))

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    expected = hf_greedy(reference, ids, 30)
    assert expected == greedy[: at + 1]  # transformers stops there too
    mesh = await start_mesh(model, [splits(3, 5)])
    try:
        got, text, responses = await collect(mesh.router_stub.Generate(request(ids, 30), timeout=60))
    finally:
        await mesh.stop()
    assert got == expected
    assert responses[-1].finish_reason == router_pb2.FINISH_REASON_EOS
    assert text == tokenizer.decode(got[:-1], skip_special_tokens=True)


# 2. Priority aging ----------------------------------------------------------------------------------


async def test_aging_lifts_a_batch_request_to_fresh_normal_ones_and_never_above_one_that_waited():
    """PriorityAdmission with one slot: a batch request that waited aging_s and more ranks with a normal request
    that arrives now (ahead of it, being older) but behind every normal one that waited, and a normal one that
    waited long ranks behind a high one that waited at all: aging lifts a request one class at most (issue 45:
    uncapped, a batch flood outranked fresh high-priority requests after 2 * aging_s)."""
    aging = 0.2
    admission = PriorityAdmission(AdmissionConfig(slots_per_chain=1, aging_s=aging), lambda: 1)
    await admission.acquire(0)  # the one slot, taken
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await admission.acquire(priority)
        order.append(name)

    tasks = [asyncio.ensure_future(wait("batch", -1))]
    await until(lambda: admission.waiting_in("batch") == 1, 5, "the batch request waits")
    tasks.append(asyncio.ensure_future(wait("normal-soon-after", 0)))
    await until(lambda: admission.waiting_in("normal") == 1, 5, "the first normal request waits")
    await asyncio.sleep(5 * aging)
    tasks += [asyncio.ensure_future(wait(f"normal-later-{i}", 0)) for i in range(2)]
    await until(lambda: admission.waiting_in("normal") == 3, 5, "three normal requests wait")
    tasks.append(asyncio.ensure_future(wait("high", 1)))
    await until(lambda: admission.waiting_in("high") == 1, 5, "the high request waits")
    for admitted in range(1, 6):
        admission.release()  # the running one ends: the most urgent waiter goes next
        await until(lambda n=admitted: len(order) == n, 5, "a waiter is admitted")
    await asyncio.gather(*tasks)
    assert order == ["high", "normal-soon-after", "normal-later-0", "normal-later-1", "batch"]
    assert admission.running == 1 and not admission.waiting


async def test_waiters_let_in_by_a_chain_coming_up_show_in_the_admission_gauges():
    """PriorityAdmission: when a chain comes up (capacity_changed), waiters are let in, and the
    waiting/running gauges say so at once, not at the next request's end."""
    chains = [1]
    admission = PriorityAdmission(AdmissionConfig(slots_per_chain=1), lambda: chains[0])
    await admission.acquire(0)
    waiters = [asyncio.ensure_future(admission.acquire(0)) for _ in range(2)]
    await until(lambda: len(admission.waiting) == 2, 5, "two wait")
    chains[0] = 2
    admission.capacity_changed()
    await until(lambda: sum(w.done() for w in waiters) == 1, 5, "one is let in")
    assert (admission.running, len(admission.waiting)) == (2, 1)
    assert (gauge("stagemesh_router_running_requests"), gauge("stagemesh_router_waiting_requests")) == (2, 1)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


# 3. The call's deadline while queued ----------------------------------------------------------------


async def test_a_queued_requests_deadline_is_honoured_and_it_never_runs(tiny_model):
    """With the one slot held, requests of every class whose deadline (0.5 s) passes while they wait
    get DEADLINE_EXCEEDED at their deadline, not at their class's wait limit (30 s); none opens a
    session; the queue and slot counts stay right, so the next request is served."""
    limits = {c: ClassLimits(max_wait_s=30) for c in ("high", "normal", "batch")}
    mesh = await start_mesh(tiny_model, [splits(8)],
                            stage_options={"batcher": BatcherConfig(batch_window_ms=5)},  # >= 5 ms a token
                            router_options={"admission": AdmissionConfig(slots_per_chain=1, limits=limits)})
    try:
        stage, queue, stub = mesh.stages[0][0], mesh.router.admission, mesh.router_stub
        holder_call = stub.Generate(request([5, 6], 1500), timeout=120)
        holder = asyncio.ensure_future(collect(holder_call))
        await until(lambda: len(stage.sessions) == 1, 10, "the holder runs")
        opened = stage.sessions.open_attempts
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(collect(stub.Generate(request([5, 7], 4, priority=p), timeout=0.5)) for p in (1, 0, -1)),
            return_exceptions=True)
        waited = time.monotonic() - t0
        codes = [r.code() if isinstance(r, grpc.aio.AioRpcError) else r for r in results]
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3
        assert waited < 10  # the deadline, long before the 30 s limit
        assert not holder.done()  # they were really queued behind it all along
        await until(lambda: not queue.waiting, 5, "the expired requests leave the queue")
        assert queue.running == 1 and stage.sessions.open_attempts == opened
        assert gauge("stagemesh_router_waiting_requests") == 0  # what the metrics say, too
        assert gauge("stagemesh_router_running_requests") == 1
        holder_call.cancel()  # the call itself: cancelling the task reading it leaves the call to the collector
        holder.cancel()
        await until(lambda: queue.running == 0, 10, "the holder's slot is given back")
        got, _, responses = await collect(stub.Generate(request([5, 8], 6), timeout=60))
        assert len(got) == 6 and responses[-1].finish_reason == router_pb2.FINISH_REASON_LENGTH
        assert stage.sessions.open_attempts == opened + 1  # only this one ran
    finally:
        await mesh.stop()


async def test_a_caller_that_leaves_the_queue_is_gone_from_it_and_from_its_metrics(tiny_model):
    """A queued call the caller cancels: it leaves the queue at once, the waiting gauge says so (it is
    what operators watch for saturation), it never runs, and the next request is served."""
    mesh = await start_mesh(tiny_model, [splits(8)],
                            stage_options={"batcher": BatcherConfig(batch_window_ms=5)},  # >= 5 ms a token
                            router_options={"admission": AdmissionConfig(slots_per_chain=1)})
    try:
        stage, queue, stub = mesh.stages[0][0], mesh.router.admission, mesh.router_stub
        holder_call = stub.Generate(request([5, 6], 1500), timeout=120)
        holder = asyncio.ensure_future(collect(holder_call))
        await until(lambda: len(stage.sessions) == 1, 10, "the holder runs")
        opened = stage.sessions.open_attempts
        calls = [stub.Generate(request([5, 7], 4, priority=p), timeout=60) for p in (1, 0, -1)]
        waiting = [asyncio.ensure_future(collect(c)) for c in calls]
        await until(lambda: len(queue.waiting) == 3, 10, "three wait")
        assert gauge("stagemesh_router_waiting_requests") == 3
        for call in calls:
            call.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await until(lambda: not queue.waiting, 5, "the cancelled requests leave the queue")
        assert gauge("stagemesh_router_waiting_requests") == 0
        assert queue.running == 1 and not holder.done() and stage.sessions.open_attempts == opened
        holder_call.cancel()  # the call itself: cancelling the task reading it leaves the call to the collector
        holder.cancel()
        await until(lambda: queue.running == 0, 10, "the holder's slot is given back")
        got, _, _ = await collect(stub.Generate(request([5, 8], 6), timeout=60))
        assert len(got) == 6 and stage.sessions.open_attempts == opened + 1
    finally:
        await mesh.stop()


def gauge(name: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name)


# 4. Failover of any stage ---------------------------------------------------------------------------

FAILOVER_CHAINS = [splits(2, 3, 3), splits(3, 3, 2)]


def busy_chain(mesh) -> int:
    """The one chain whose first stage holds a session (the stream's)."""
    busy = [c for c, chain in enumerate(mesh.stages) if len(chain[0].sessions)]
    assert len(busy) == 1, busy
    return busy[0]


@pytest.mark.parametrize("victim", [0, 1], ids=["first", "middle"])
async def test_a_stream_survives_its_first_or_middle_stage_dying_mid_decode(tiny_model, hf_models, victim):
    """Two chains of three stages; the first (or middle) stage of the chain carrying the stream is
    killed after 10 tokens: the stream completes with exactly the tokens of an undisturbed run."""
    ids = prompt(20, seed=41 + victim)
    expected = hf_greedy(hf_models["llama"], ids, 40)
    mesh = await start_mesh(tiny_model, FAILOVER_CHAINS)
    try:
        got, killed = [], None
        async for r in mesh.router_stub.Generate(request(ids, 40), timeout=120):
            got.extend(r.token_ids)
            if len(got) == 10:
                killed = busy_chain(mesh)
                await mesh.stages[killed][victim].stop(0)
        assert got == expected
        assert mesh.stages[1 - killed][-1].batcher.batches_run > 0  # the other chain finished it
        want = [c != killed for c in range(2)]  # the health checks (every 0.2 s) see the dead stage
        await until(lambda: [c.healthy for c in mesh.router.chains.chains] == want, 10, "the chain marked down")
        chains = (await mesh.router_stub.ListChains(router_pb2.ListChainsRequest())).chains
        assert [c.healthy for c in chains] == want
    finally:
        await mesh.stop()


@pytest.fixture(scope="module")
def long_prompt_reference(hf_models):
    ids = prompt(600, seed=43)
    return ids, hf_greedy(hf_models["llama"], ids, 10)


@pytest.mark.parametrize("victim", [0, 1, 2], ids=["first", "middle", "last"])
async def test_a_stage_dying_during_pipelined_prefill_gives_the_exact_result(tiny_model, long_prompt_reference,
                                                                             victim):
    """A 600-token prompt in 64-token chunks: a stage is killed while the chain's last stage has
    some chunks and its first stage still has chunks to go (the pipeline full); the stream's tokens
    are exactly those of an undisturbed run, and the other chain produced them."""
    ids, expected = long_prompt_reference
    mesh = await start_mesh(tiny_model, FAILOVER_CHAINS,
                            # each pass waits 10 ms for company: the prefill lasts long enough to catch
                            stage_options={"batcher": BatcherConfig(batch_window_ms=10, max_batch_tokens=64)},
                            router_options={"generation": GenerationConfig(prefill_chunk=64)})
    try:
        await collect(mesh.router_stub.Generate(request(ids[:130], 1), timeout=60))  # every stage warmed up

        def prefilled(chain: int, stage: int) -> int | None:
            sessions = mesh.stages[chain][stage].sessions.sessions
            return next(iter(sessions.values())).cache.length if sessions else None

        def mid_prefill() -> int | None:
            """The chain whose first stage has chunks to go while its last stage has some already."""
            for c in range(2):
                first, last = prefilled(c, 0), prefilled(c, -1)
                if first is not None and first < len(ids) and last is not None and last >= 64:
                    return c
            return None

        call = asyncio.ensure_future(collect(mesh.router_stub.Generate(request(ids, 10), timeout=120)))
        await until(lambda: mid_prefill() is not None, 30, "the pipeline full, mid-prefill", every=0.002)
        killed = mid_prefill()
        await mesh.stages[killed][victim].stop(0)
        assert not call.done()
        got, _, _ = await call
        assert got == expected
        assert mesh.stages[1 - killed][-1].batcher.batches_run > 0
    finally:
        await mesh.stop()


# 5. A stage that comes back --------------------------------------------------------------------------


async def test_a_stage_that_comes_back_on_its_address_is_used_again_soon(tiny_model, hf_models):
    """A stage down for a while (6 s) is restarted on the same host:port with the same layers right after
    one of the router's reconnect attempts: the router's checks find the chain healthy again within a
    few seconds (not after a reconnect backoff that grew while it was down), and requests reach it."""
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(2, 6)])
    attempts: list[float] = []
    listener = None
    try:
        old = mesh.stages[0][1]
        port, model = old.port, old.model
        await old.stop(0)
        down_since = time.monotonic()
        await until(lambda: not mesh.router.chains.chains[0].healthy, 10, "the chain is marked down")

        # Nothing serves the address; a bare listener there only notes the router's reconnect attempts.
        def attempt(_reader, writer) -> None:
            attempts.append(time.monotonic())
            writer.close()

        listener = await asyncio.start_server(attempt, "127.0.0.1", port)
        await until(lambda: attempts and attempts[-1] > down_since + 6, 60, "a reconnect attempt after 6 s")
        listener.close()
        await listener.wait_closed()
        listener = None

        new = StageServer(StageConfig(model=str(tiny_model), layer_start=4, layer_end=8, port=port, kv_cache_gb=1.0))
        mesh.stages[0][1] = new
        await new.start(model)
        back = time.monotonic()
        stub = mesh.router_stub
        await mesh.router.chains.check(mesh.router.chains.chains[1])  # this machine's pace, now: a health check
        check_s = time.monotonic() - back
        healthy = await until(lambda: mesh.router.chains.chains[0].healthy, 60, "the chain is healthy again")
        # By the router's next reconnect attempt (the claim: one a second, gRPC adding up to 20% jitter) and the
        # health check after it (every 0.2 s here); for the connection, the calls and a stalled loop, ten health
        # checks' time on this machine, at least 1.5 s. A backoff grown while the stage was down (gRPC's default,
        # x1.6 an attempt) leaves it unused about 3 s or more after 6 s down (5.4 to 7.3 s seen).
        bound = 1.2 * 1.0 + mesh.router.config.health_interval_s + max(1.5, 10 * check_s)
        assert healthy - back < bound, f"used again only {healthy - back:.1f}s after it came back (> {bound:.1f}s)"
        chains = (await stub.ListChains(router_pb2.ListChainsRequest())).chains
        assert [c.healthy for c in chains] == [True, True]

        ids = prompt(10, seed=47)
        results = await asyncio.gather(*(collect(stub.Generate(request(ids, 8), timeout=60)) for _ in range(4)))
        assert [r[0] for r in results] == [hf_greedy(hf_models["llama"], ids, 8)] * 4
        assert new.batcher.batches_run > 0  # traffic reached the stage that came back
    finally:
        if listener is not None:
            listener.close()
        await mesh.stop()


# 6. Sliding window and tied embeddings against transformers -----------------------------------------

VARIANTS = {
    "mistral-window16": ("mistral", {"sliding_window": 16}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied-window16": ("qwen2", {"sliding_window": 16, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def variant_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("variants")
    out = {}
    for name, (family, options) in VARIANTS.items():
        path = make_tiny_model(root / name, family, layers=4, seed=11, **options)
        out[name] = path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return out


def test_the_variants_really_have_a_window_and_tied_embeddings(variant_models):
    """The checkpoints say what they claim, and the window changes the model's output on a prompt
    longer than it (otherwise the exactness tests below would prove nothing about the window)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([prompt(40, seed=51)])
    for name, (path, model) in variant_models.items():
        config = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            has_head = "lm_head.weight" in f.keys()
        assert has_head != bool(config.get("tie_word_embeddings")), name
        if "window" in name:
            assert config["sliding_window"] == 16
            # The same weights with a window wider than the prompt: full attention.
            full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=4096).eval()
            with torch.inference_mode():
                assert not torch.allclose(model(ids).logits[0, -1], full(ids).logits[0, -1], atol=1e-3), name


@pytest.mark.parametrize("layout", [splits(4), splits(1, 3)], ids=["1-stage", "2-stage"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
async def test_window_and_tied_variants_equal_transformers(variant_models, variant, layout):
    """40 prompt tokens (longer than the 16-token window) and 24 new: greedy tokens through the chain
    equal transformers' generate() on the same checkpoint, through the router (the prompt in 7-token
    chunks) and through a session fed the whole prompt, whose last-stage logits at every step are
    within 1e-4 of transformers'."""
    path, model = variant_models[variant]
    ids = prompt(40, seed=53)
    expected = hf_greedy(model, ids, 24)
    mesh = await start_mesh(path, [layout], router_options={"generation": GenerationConfig(prefill_chunk=7)})
    try:
        got, _, _ = await collect(mesh.router_stub.Generate(request(ids, 24), timeout=60))
        assert got == expected

        new, logits = await stepped_logits([s.address for s in mesh.stages[0]], ids, 24, f"logits-{variant}")
        assert new == expected
        tokens = ids + new
        with torch.inference_mode():
            reference = model(torch.tensor([tokens])).logits[0]
        for k, row in enumerate(logits):
            torch.testing.assert_close(row, reference[len(ids) - 1 + k], atol=1e-4, rtol=0)
    finally:
        await mesh.stop()
