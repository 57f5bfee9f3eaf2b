"""The OpenAI-compatible HTTP front (`stagemesh router --http-port`), called with the official `openai` client (and
raw httpx where the wire itself is checked) against a real router and stages on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from stagemesh.log import JsonFormatter
from stagemesh.router.http_requests import MAX_BODY_BYTES, derived_seed
from stagemesh.router.http_responses import FINISH_REASONS
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.v1 import router_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.harness.fault_mesh import free_port
from tests.test_auth import BILLING, OPS, SLOW, token_file

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "The quick brown fox"
IDS = [21, 22, 23, 24, 25, 26]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny Llama with a chat template of its own, saved with its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
async def mesh(chat_model):
    mesh = await start_mesh(chat_model, [splits(4, 4)], router_options={"http_port": free_port()})
    yield mesh
    await mesh.stop()


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model)


def base_url(mesh) -> str:
    return f"{mesh.router.http.url}/v1"


def client(mesh, api_key: str = "none", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(mesh), api_key=api_key, max_retries=0, **options)


def model_name(mesh) -> str:
    return mesh.router.config.model_name


async def grpc_generate(mesh, **fields) -> tuple[list[int], str, list]:
    return await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(**fields), timeout=60))


def sse_events(text: str) -> list[str]:
    """The data of each server-sent event, in order (comments skipped)."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


async def test_completions_are_the_grpc_paths_and_transformers_tokens(mesh, hf_models, tokenizer):
    name = model_name(mesh)

    def calls():
        with client(mesh) as c:
            text = c.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
            ids = c.completions.create(model=name, prompt=IDS, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
            listed = c.completions.create(model=name, prompt=[IDS], max_tokens=12, temperature=0)
            chunks = list(c.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
            return text, ids, listed, chunks

    text, ids, listed, chunks = await asyncio.to_thread(calls)
    want_ids = hf_greedy(hf_models["llama"], IDS, 12)
    assert ids.choices[0].token_ids == want_ids
    grpc_ids, grpc_text, _ = await grpc_generate(mesh, token_ids=IDS, max_new_tokens=12)
    assert grpc_ids == want_ids and ids.choices[0].text == grpc_text == listed.choices[0].text
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert text.choices[0].prompt_token_ids == prompt_ids
    assert text.choices[0].token_ids == hf_greedy(hf_models["llama"], prompt_ids, 12)
    grpc_ids, grpc_text, _ = await grpc_generate(mesh, prompt=PROMPT, max_new_tokens=12)
    assert text.choices[0].text == grpc_text and text.choices[0].token_ids == grpc_ids
    assert text.object == "text_completion" and text.model == model_name(mesh) and text.id.startswith("cmpl-")
    assert text.choices[0].finish_reason == "length"
    assert (text.usage.prompt_tokens, text.usage.completion_tokens, text.usage.total_tokens) == (
        len(prompt_ids), 12, len(prompt_ids) + 12)
    # Streamed: the same text, one chunk per response, the finish reason on the last, usage after it.
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_applies_the_template_and_matches_transformers(mesh, hf_models, tokenizer):
    name = model_name(mesh)
    want_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]

    def calls():
        with client(mesh) as c:
            whole = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=10, temperature=0,
                                              extra_body={"return_token_ids": True})
            chunks = list(c.chat.completions.create(model=name, messages=MESSAGES, max_completion_tokens=10,
                                                    temperature=0, stream=True))
            return whole, chunks

    whole, chunks = await asyncio.to_thread(calls)
    assert whole.prompt_token_ids == want_prompt
    want = hf_greedy(hf_models["llama"], want_prompt, 10)
    assert whole.choices[0].token_ids == want
    _, grpc_text, _ = await grpc_generate(mesh, token_ids=want_prompt, max_new_tokens=10)
    message = whole.choices[0].message
    assert (message.role, message.content) == ("assistant", grpc_text)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.usage.prompt_tokens == len(want_prompt) and whole.usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == grpc_text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_the_event_stream_is_openais_on_the_wire(mesh):
    body = {"model": model_name(mesh), "prompt": IDS, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{base_url(mesh)}/completions", json=body,
                                   headers={"x-request-id": "wire-check-1"})
        chat = await http.post(f"{base_url(mesh)}/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == "wire-check-1"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and response.text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == "cmpl-wire-check-1" and c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-1] == {"id": "cmpl-wire-check-1", "object": "text_completion", "created": chunks[0]["created"],
                          "model": model_name(mesh), "choices": [],
                          "usage": {"prompt_tokens": len(IDS), "completion_tokens": 4, "total_tokens": len(IDS) + 4,
                                    "prompt_tokens_details": {"cached_tokens": chunks[-1]["usage"][
                                        "prompt_tokens_details"]["cached_tokens"]}}}
    chat_events = sse_events(chat.text)
    assert chat_events[-1] == "[DONE]"
    first = json.loads(chat_events[0])
    assert first["choices"][0]["delta"]["role"] == "assistant" and "usage" not in first


async def test_max_tokens_left_out_is_the_context_left(mesh):
    context = mesh.router.service.max_position
    ids = [10 + i % 900 for i in range(context - 3)]

    def call():
        with client(mesh) as c:
            return c.completions.create(model=model_name(mesh), prompt=ids, temperature=0,
                                        extra_body={"ignore_eos": True, "min_tokens": 1})

    done = await asyncio.to_thread(call)
    assert done.usage.completion_tokens <= 3
    assert done.choices[0].finish_reason == "length" or done.usage.completion_tokens < 3


async def test_n_choices_with_a_seed_differ_and_come_again(mesh):
    def call(**more):
        with client(mesh) as c:
            return c.completions.create(model=model_name(mesh), prompt=IDS, max_tokens=16, temperature=1.0, n=2,
                                        extra_body={"return_token_ids": True}, **more)

    first, again = await asyncio.to_thread(call, seed=1234), await asyncio.to_thread(call, seed=1234)
    pair = [c.token_ids for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert pair[0] != pair[1]
    assert [c.token_ids for c in sorted(again.choices, key=lambda c: c.index)] == pair
    assert first.usage.completion_tokens == 32 and first.usage.prompt_tokens == len(IDS)
    # Choice 0 is what a gRPC call with that seed gives; choice 1 what one with the derived seed gives.
    for index, seed in ((0, 1234), (1, derived_seed(1234, 1))):
        ids, _, _ = await grpc_generate(mesh, token_ids=IDS, max_new_tokens=16, temperature=1.0, top_p=1.0, seed=seed)
        assert ids == pair[index]

    def streamed():
        with client(mesh) as c:
            chunks = list(c.completions.create(model=model_name(mesh), prompt=IDS, max_tokens=16, temperature=1.0,
                                               n=2, seed=1234, stream=True, extra_body={"return_token_ids": True}))
        return {i: [t for c in chunks for ch in c.choices if ch.index == i for t in ch.token_ids] for i in (0, 1)}

    assert await asyncio.to_thread(streamed) == {0: pair[0], 1: pair[1]}


async def test_identical_sampled_requests_without_a_seed_differ(mesh):
    # Needs the router to draw a fresh seed when none is given (issue 47's `optional uint64 seed`).
    def call():
        with client(mesh) as c:
            return c.completions.create(model=model_name(mesh), prompt=IDS, max_tokens=16, temperature=1.0,
                                        extra_body={"return_token_ids": True}).choices[0].token_ids

    assert await asyncio.to_thread(call) != await asyncio.to_thread(call)


def test_eos_is_openais_stop():
    assert FINISH_REASONS == {router_pb2.FINISH_REASON_LENGTH: "length", router_pb2.FINISH_REASON_STOP: "stop",
                              router_pb2.FINISH_REASON_EOS: "stop"}


async def test_a_stop_string_ends_the_text_with_finish_reason_stop(mesh):
    _, full, _ = await grpc_generate(mesh, token_ids=IDS, max_new_tokens=12)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip()

    def call():
        with client(mesh) as c:
            return c.completions.create(model=model_name(mesh), prompt=IDS, max_tokens=12, temperature=0, stop=stop)

    done = await asyncio.to_thread(call)
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text == full[:full.index(stop)]


async def test_models_and_health(mesh):
    async with httpx.AsyncClient(timeout=10) as http:
        health = await http.get(f"{mesh.router.http.url}/health")
        models = await http.get(f"{base_url(mesh)}/models")
        one = await http.get(f"{base_url(mesh)}/models/{model_name(mesh)}")
        other = await http.get(f"{base_url(mesh)}/models/gpt-4")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert models.json()["data"][0]["id"] == model_name(mesh) and models.json()["object"] == "list"
    assert one.json()["id"] == model_name(mesh)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"

    def listed():
        with client(mesh) as c:
            return [m.id for m in c.models.list()]

    assert await asyncio.to_thread(listed) == [model_name(mesh)]


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


BAD_COMPLETIONS = [
    ("not json", b'{"prompt": "x", ', 400, None),
    ("not an object", b'["prompt"]', 400, None),
    ("a string for max_tokens", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("no prompt", {"max_tokens": 2}, 400, "prompt"),
    ("a prompt of the wrong type", {"prompt": {"text": "x"}, "max_tokens": 2}, 400, "prompt"),
    ("two prompts", {"prompt": ["a", "b"], "max_tokens": 2}, 400, "prompt"),
    ("an empty prompt", {"prompt": [], "max_tokens": 2}, 400, None),
    ("a token outside the vocabulary", {"prompt": [5, 10**6], "max_tokens": 2}, 400, None),
    ("a negative temperature", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p above 1", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n above the bound", {"prompt": "x", "n": 9}, 400, "n"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("echo", {"prompt": "x", "echo": True}, 400, "echo"),
    ("a logit_bias key that is no token id", {"prompt": "x", "logit_bias": {"the": 1.0}}, 400, "logit_bias"),
    ("a bad request id", {"prompt": "x"}, 400, "x-request-id"),
    ("an unknown model", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), [b[1:] for b in BAD_COMPLETIONS],
                         ids=[b[0] for b in BAD_COMPLETIONS])
async def test_bad_input_gets_an_openai_error_object(mesh, body, status, param):
    headers = {"x-request-id": "has a space"} if param == "x-request-id" else {}
    async with httpx.AsyncClient(timeout=30) as http:
        url = f"{base_url(mesh)}/completions"
        response = await (http.post(url, content=body, headers=headers) if isinstance(body, bytes)
                          else http.post(url, json=body, headers=headers))
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["param"] == param and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


async def test_prompts_past_the_context_are_400_with_openais_code(mesh):
    context = mesh.router.service.max_position
    async with httpx.AsyncClient(timeout=30) as http:
        url = f"{base_url(mesh)}/completions"
        long = await http.post(url, json={"prompt": [7] * context, "max_tokens": 1})
        over = await http.post(url, json={"prompt": IDS, "max_tokens": context})
        huge = await http.post(url, json={"prompt": "word " * (context * 64), "max_tokens": 1})
        chat = await http.post(f"{base_url(mesh)}/chat/completions",
                               json={"messages": [{"role": "user", "content": "word " * context}], "max_tokens": 1})
    for response in (long, over, huge, chat):
        assert response.status_code == 400, response.text
        assert error_of(response)["code"] == "context_length_exceeded"
    assert "max_tokens" in error_of(over)["message"] and "max_new_tokens" not in error_of(over)["message"]


async def test_a_body_past_the_limit_is_413(mesh):
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{base_url(mesh)}/completions", content=b" " * (MAX_BODY_BYTES + 1),
                                   headers={"content-type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "body_too_large"


async def test_bad_chat_input(mesh, tiny_model):
    async with httpx.AsyncClient(timeout=30) as http:
        url = f"{base_url(mesh)}/chat/completions"
        no_messages = await http.post(url, json={"messages": []})
        bad_role = await http.post(url, json={"messages": [{"role": "wizard", "content": "x"}]})
        image = await http.post(url, json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
        tools = await http.post(url, json={"messages": MESSAGES, "tools": [{"type": "function"}]})
        top = await http.post(url, json={"messages": MESSAGES, "top_logprobs": 2})
        unknown = await http.post(url, json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                             "some_future_field": {"x": 1}})
        parts = await http.post(url, json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hello there"}]}], "max_tokens": 2, "temperature": 0})
        route = await http.get(f"{base_url(mesh)}/nowhere")
    for response, param in ((no_messages, "messages"), (bad_role, "messages"), (image, "messages"),
                            (tools, "tools"), (top, "top_logprobs")):
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == param
    assert unknown.status_code == 200, unknown.text  # unknown fields are ignored, as vLLM and OpenAI do
    assert parts.status_code == 200, parts.text
    assert route.status_code == 404 and error_of(route)["message"]


async def test_chat_without_a_template_is_a_clear_400(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={"http_port": free_port()})
    try:
        def call():
            with client(mesh) as c:
                c.chat.completions.create(model=model_name(mesh), messages=MESSAGES, max_tokens=2)

        with pytest.raises(openai.BadRequestError) as err:
            await asyncio.to_thread(call)
        assert err.value.status_code == 400 and err.value.code == "no_chat_template"
        assert "no chat template" in err.value.message
    finally:
        await mesh.stop()


async def test_a_client_that_leaves_mid_stream_frees_its_sessions_on_every_stage(mesh):
    async def leave_early(body: dict) -> None:
        async with httpx.AsyncClient(timeout=60) as http, http.stream(
                "POST", f"{base_url(mesh)}/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # and the connection closes, mid-stream

    for n in (1, 2):
        await leave_early({"prompt": IDS, "max_tokens": 400, "temperature": 0.7, "stream": True, "n": n,
                           "extra": "ignored"})
        infos = await mesh.settled_infos(within_s=20)
        assert [(i.open_sessions, i.kv_used_bytes) for i in infos] == [(0, 0)] * 2, n
    assert mesh.router.admission.running == 0


async def test_a_client_that_leaves_before_a_whole_answer_frees_its_sessions(mesh):
    async with httpx.AsyncClient(timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{base_url(mesh)}/completions",
                            json={"prompt": IDS, "max_tokens": 450, "temperature": 0.7, "ignore_eos": True})
    infos = await mesh.settled_infos(within_s=20)
    assert [(i.open_sessions, i.kv_used_bytes) for i in infos] == [(0, 0)] * 2
    assert mesh.router.admission.running == 0


async def test_requests_and_tokens_are_counted_as_for_grpc(mesh):
    def sample(name: str, labels: dict | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    before = (sample("stagemesh_router_requests_total", {"status": "OK"}), sample("stagemesh_router_tokens_total"),
              sample("stagemesh_router_time_to_first_token_seconds_count", {"priority_class": "high"}))
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{base_url(mesh)}/completions", json={"prompt": IDS, "max_tokens": 5},
                                   headers={"x-priority": "3"})
    assert response.status_code == 200
    after = (sample("stagemesh_router_requests_total", {"status": "OK"}), sample("stagemesh_router_tokens_total"),
             sample("stagemesh_router_time_to_first_token_seconds_count", {"priority_class": "high"}))
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 5, 1]


async def test_a_cache_salt_in_the_body_narrows_the_prefix_cache(mesh):
    """vLLM's cache_salt: the same caller's requests share blocks only under the same salt; over 256 bytes, a 400."""
    ids = list(range(300, 340))  # 2 full blocks of 16 before the last token

    async def cached(**salt) -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(f"{base_url(mesh)}/completions",
                                       json={"prompt": ids, "max_tokens": 2, **salt})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [await cached(cache_salt=s) for s in ("red", "blue", "red")] == [0, 0, 32]
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{base_url(mesh)}/completions",
                                   json={"prompt": ids, "max_tokens": 2, "cache_salt": "x" * 257})
    assert response.status_code == 400 and "cache_salt" in response.json()["error"]["message"]


async def test_no_usable_chain_is_503_and_health_says_so(tiny_model):
    http_port = free_port()
    router = RouterServer(RouterConfig(model=str(tiny_model), chains=[f"127.0.0.1:{free_port()}"], port=0,
                                       health_interval_s=0.2, http_port=http_port))
    await router.start()
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            health = await http.get(f"http://127.0.0.1:{http_port}/health")
            response = await http.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                       json={"prompt": IDS, "max_tokens": 2})
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert response.status_code == 503 and error_of(response)["type"] == "server_error"
    finally:
        await router.stop(0)


async def test_a_stopping_router_finishes_its_http_streams_and_says_it_is_stopping(chat_model):
    mesh = await start_mesh(chat_model, [splits(4, 4)], router_options={"http_port": free_port()})
    stopped = False
    try:
        url = mesh.router.http.url
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{url}/v1/completions", json={
                    "prompt": IDS, "max_tokens": 40, "temperature": 0, "stream": True}) as response:
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                stopping = asyncio.ensure_future(mesh.router.stop(30))
                await asyncio.sleep(0.3)
                rest = [line async for line in lines]
            await stopping
            stopped = True
        events = sse_events("\n".join(rest))
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.ConnectError):  # and then takes no more
            async with httpx.AsyncClient(timeout=5) as http:
                await http.get(f"{url}/health")
    finally:
        if stopped:
            mesh.router = None
        await mesh.stop()


# Tokens, priorities and rates: the same file, the same limits as over gRPC (tests/test_auth.py).
@pytest.fixture(scope="module")
async def guarded(chat_model, tmp_path_factory):
    path = token_file(tmp_path_factory.mktemp("http-auth") / "tokens.json",
                      {"name": "billing", "token": BILLING, "max_priority": 0, "requests_per_second": 1000},
                      {"name": "ops", "token": OPS, "max_priority": 5},
                      {"name": "slow", "token": SLOW, "requests_per_second": 0.1})
    mesh = await start_mesh(chat_model, [splits(8)], router_options={"auth_tokens": str(path),
                                                                     "http_port": free_port()})
    yield mesh
    await mesh.stop()


@pytest.mark.parametrize("api_key", ["", "not-a-token-of-ours-at-all", BILLING[:-1]], ids=["none", "wrong", "prefix"])
async def test_without_a_valid_token_http_calls_are_401(guarded, api_key):
    def calls():
        refused = []
        with client(guarded, api_key=api_key or "x", default_headers={} if api_key else {"Authorization": ""}) as c:
            for call in (lambda: c.completions.create(model=model_name(guarded), prompt=IDS, max_tokens=2),
                         lambda: c.chat.completions.create(model=model_name(guarded), messages=MESSAGES,
                                                           max_tokens=2),
                         lambda: c.models.list()):
                with pytest.raises(openai.AuthenticationError) as err:
                    call()
                refused.append(err.value)
        return refused

    for err in await asyncio.to_thread(calls):
        assert err.status_code == 401 and err.code == "invalid_api_key"
    async with httpx.AsyncClient(timeout=10) as http:  # health stays open
        assert (await http.get(f"{guarded.router.http.url}/health")).status_code == 200


async def test_a_tokens_priority_and_rate_hold_over_http(guarded):
    name = model_name(guarded)

    def calls():
        out = {}
        with client(guarded, api_key=BILLING) as billing:
            out["ok"] = billing.completions.create(model=name, prompt=IDS, max_tokens=2, temperature=0)
            with pytest.raises(openai.PermissionDeniedError) as field:
                billing.completions.create(model=name, prompt=IDS, max_tokens=2, extra_body={"priority": 1})
            out["field"] = field.value
            with pytest.raises(openai.PermissionDeniedError) as header:
                billing.completions.create(model=name, prompt=IDS, max_tokens=2,
                                           extra_headers={"x-priority": "1"})
            out["header"] = header.value
            out["batch"] = billing.completions.create(model=name, prompt=IDS, max_tokens=2,
                                                      extra_headers={"x-priority": "-3"})
        with client(guarded, api_key=OPS) as ops:
            out["ops"] = ops.completions.create(model=name, prompt=IDS, max_tokens=2, extra_body={"priority": 5})
        with client(guarded, api_key=SLOW) as slow:
            out["first"] = slow.models.list()
            with pytest.raises(openai.RateLimitError) as rate:
                slow.completions.create(model=name, prompt=IDS, max_tokens=2)
            out["rate"] = rate.value
        return out

    out = await asyncio.to_thread(calls)
    assert out["ok"].choices[0].finish_reason == "length"
    for key in ("field", "header"):
        assert out[key].status_code == 403 and "max_priority 0" in out[key].message and "billing" in out[key].message
    assert out["batch"].usage.completion_tokens == 2 and out["ops"].usage.completion_tokens == 2
    assert out["rate"].status_code == 429 and "0.1 requests per second" in out["rate"].message


async def test_n_choices_cost_n_requests_of_a_callers_rate(guarded, tmp_path):
    # SLOW's burst is one request: two choices at once are more than it allows (as a GenerateBatch of two).
    guarded.router.auth.buckets["slow"].level = 1.0
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{base_url(guarded)}/completions", json={"prompt": IDS, "max_tokens": 2, "n": 2},
                                   headers={"authorization": f"Bearer {SLOW}"})
    assert response.status_code == 429 and "split the batch" in error_of(response)["message"]


async def test_the_request_id_and_the_caller_are_in_the_routers_log_lines(guarded, caplog):
    caplog.set_level(logging.INFO, logger="stagemesh.router")
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{base_url(guarded)}/completions", json={"prompt": IDS, "max_tokens": 2},
                                   headers={"authorization": f"Bearer {BILLING}", "x-request-id": "r-http-7"})
        refused = await http.post(f"{base_url(guarded)}/completions", json={"prompt": IDS, "max_tokens": 2},
                                  headers={"authorization": f"Bearer {BILLING}", "x-priority": "9"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "r-http-7"
    assert refused.status_code == 403 and refused.headers["x-request-id"]
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    assert any(e.get("request_id") == "r-http-7" and e.get("caller") == "billing" and "generate" in e["msg"]
               for e in lines), lines
    assert any(e.get("code") == "PERMISSION_DENIED" and e.get("caller") == "billing"
               and "POST /v1/completions" in e["msg"] for e in lines), lines
    assert not any(BILLING in json.dumps(e) for e in lines)


async def test_an_http_request_is_one_trace_across_the_router_and_every_stage(chat_model):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stagemesh.tracing import setup_tracing, stop_tracing

    spans = InMemorySpanExporter()
    assert setup_tracing("stagemesh-test", None, spans)
    try:
        mesh = await start_mesh(chat_model, [splits(4, 4)], router_options={"http_port": free_port()})
        try:
            spans.clear()
            trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
            async with httpx.AsyncClient(timeout=30) as http:
                for stream in (False, True):
                    response = await http.post(f"{base_url(mesh)}/completions", json={
                        "prompt": IDS, "max_tokens": 3, "stream": stream},
                        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
                    assert response.status_code == 200
        finally:
            await mesh.stop()
    finally:
        stop_tracing()
    finished = spans.get_finished_spans()
    http_spans = [s for s in finished if s.name == "POST /v1/completions"]
    assert len(http_spans) == 2 and all(f"{s.context.trace_id:032x}" == trace_id for s in http_spans)
    for root in http_spans:  # the caller's trace goes on through the router's opens on both stages
        children = [s for s in finished if s.parent is not None and s.parent.span_id == root.context.span_id]
        assert sum(s.name.endswith("Stage/OpenSession") and s.kind.name == "CLIENT" for s in children) == 2
    in_trace = [s for s in finished if f"{s.context.trace_id:032x}" == trace_id]
    assert sum(s.name.endswith("Stage/OpenSession") and s.kind.name == "SERVER" for s in in_trace) == 4


async def test_https_with_the_routers_certificate_and_callers_certificates(tiny_model, tmp_path):
    import ssl

    from stagemesh import tls
    from stagemesh.certs import CertsConfig, make_certs

    mesh_tls = tls.load(make_certs(CertsConfig(str(tmp_path / "mesh"), roles=["mesh"])))
    callers = tls.load(make_certs(CertsConfig(str(tmp_path / "callers"), roles=["mesh"])))
    secure = {"tls": str(mesh_tls.directory)}
    mesh = await start_mesh(tiny_model, [splits(8)], stage_options=secure,
                            router_options={**secure, "http_port": free_port(), "client_ca": str(callers.ca_path)})
    try:
        assert mesh.router.http.url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(mesh_tls.ca_path))
        with_cert = ssl.create_default_context(cafile=str(mesh_tls.ca_path))
        with_cert.load_cert_chain(callers.cert_path, callers.key_path)

        async def health(verify) -> int:
            async with httpx.AsyncClient(verify=verify, timeout=10) as http:
                return (await http.get(f"{mesh.router.http.url}/health")).status_code

        assert await health(with_cert) == 200
        for refused in (trusting, False):  # no caller certificate; plaintext never gets that far
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await health(refused)
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            async with httpx.AsyncClient(timeout=10) as http:
                await http.get(mesh.router.http.url.replace("https://", "http://") + "/health")

        def call():
            with client(mesh, http_client=httpx.Client(verify=with_cert)) as c:
                return c.completions.create(model=model_name(mesh), prompt=IDS, max_tokens=3, temperature=0)

        assert (await asyncio.to_thread(call)).usage.completion_tokens == 3
    finally:
        await mesh.stop()


def test_the_flags_reach_the_router_and_up():
    from stagemesh import cli
    from stagemesh.config_flags import from_args
    from stagemesh.launcher import UpConfig

    args = cli.parse(["router", "--model", "m", "--chain", "127.0.0.1:1", "--http-port", "8000"])
    assert from_args(RouterConfig, args).http_port == 8000
    assert from_args(RouterConfig, cli.parse(["router", "--model", "m", "--chain", "127.0.0.1:1"])).http_port is None
    assert from_args(UpConfig, cli.parse(["up", "--http-port", "8001"])).http_port == 8001
    with pytest.raises(ValueError, match="--http-port"):
        RouterConfig(model="m", chains=["127.0.0.1:1"], http_port=70000)


async def test_every_sampling_field_reaches_the_same_request_as_over_grpc(mesh):
    """The body's fields become the proto's: a seeded sampled request with all of them gives the tokens a gRPC call
    with the same fields gives."""
    fields = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "presence_penalty": 0.5,
              "frequency_penalty": 0.25, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [3],
              "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{base_url(mesh)}/completions", json={
            "prompt": IDS, "max_tokens": 10, "seed": 99, "logit_bias": {"42": 5.0}, "return_token_ids": True,
            **fields})
    assert response.status_code == 200, response.text
    ids, _, _ = await grpc_generate(mesh, token_ids=IDS, max_new_tokens=10, seed=99, logit_bias={42: 5.0}, **fields)
    assert response.json()["choices"][0]["token_ids"] == ids


async def test_logprobs_are_the_grpc_paths_in_openais_shapes(mesh):
    # Needs the router to compute logprobs (issue 47's GenerateResponse.logprobs).
    _, _, responses = await grpc_generate(mesh, token_ids=IDS, max_new_tokens=4, logprobs=True, top_logprobs=2)
    want = [(lp.token_id, lp.logprob) for r in responses for lp in r.logprobs]
    assert len(want) == 4
    async with httpx.AsyncClient(timeout=60) as http:
        completion = (await http.post(f"{base_url(mesh)}/completions", json={
            "prompt": IDS, "max_tokens": 4, "temperature": 0, "logprobs": 2})).json()
    got = completion["choices"][0]["logprobs"]
    assert got["token_logprobs"] == pytest.approx([w[1] for w in want])
    assert [len(top) for top in got["top_logprobs"]] == [2] * 4


def test_answers_are_in_openais_shapes():
    """A call's answer from GenerateResponses that carry logprobs and usage (as the stages report them)."""
    from stagemesh.router.generation import GenerationRequest
    from stagemesh.router.http_requests import ChatBody, CompletionBody
    from stagemesh.router.http_responses import Call, Choice, chunk, usage_chunk, whole

    def responses():
        lp = [router_pb2.TokenLogprob(token_id=t, logprob=-0.5 * i, top=[router_pb2.TopLogprob(token_id=t,
                                                                                              logprob=-0.5 * i)])
              for i, t in enumerate((7, 8))]
        return [router_pb2.GenerateResponse(token_ids=[7], text="ab", logprobs=lp[:1]),
                router_pb2.GenerateResponse(token_ids=[8], text="c", logprobs=lp[1:], cached_tokens=2,
                                            finish_reason=router_pb2.FINISH_REASON_EOS,
                                            usage=router_pb2.Usage(prompt_tokens=3, completion_tokens=2,
                                                                   cached_tokens=2))]

    text = {7: "ab", 8: "c"}.__getitem__
    req = GenerationRequest(request_id="r1", prompt_ids=[1, 2, 3], max_new_tokens=2)
    completion = Call("completion", CompletionBody(prompt="x", logprobs=1), "r1", "m", created=5, reqs=[req],
                      choices=[Choice()])
    for r in responses():
        completion.choices[0].add(r)
    assert whole(completion, text) == {
        "id": "cmpl-r1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "abc", "finish_reason": "stop", "logprobs": {
            "tokens": ["ab", "c"], "token_logprobs": [0.0, -0.5], "top_logprobs": [{"ab": 0.0}, {"c": -0.5}],
            "text_offset": [0, 2]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 2}}}
    chat = Call("chat", ChatBody(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=1,
                                 stream=True, stream_options={"include_usage": True}), "r2", "m", created=5,
                reqs=[req], choices=[Choice()])
    events = [json.loads(chunk(chat, 0, r, text)) for r in responses()]
    assert events[0] == {"id": "chatcmpl-r2", "object": "chat.completion.chunk", "created": 5, "model": "m",
                         "usage": None, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ab"},
                                                     "finish_reason": None, "logprobs": {"content": [
                                                         {"token": "ab", "logprob": 0.0, "bytes": [97, 98],
                                                          "top_logprobs": [{"token": "ab", "logprob": 0.0,
                                                                            "bytes": [97, 98]}]}], "refusal": None}}]}
    assert events[1]["choices"][0]["delta"] == {"content": "c"} and events[1]["choices"][0]["finish_reason"] == "stop"
    assert json.loads(usage_chunk(chat))["usage"]["completion_tokens"] == 2
