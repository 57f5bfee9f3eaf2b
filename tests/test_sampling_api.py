"""Issue 47's sampling API on the gRPC path, through a real router and stages: logprobs and top_logprobs equal
transformers' log-softmax of the same model, repetition_penalty equals transformers'
generate(repetition_penalty=...), logit_bias, the seed rule, stop_token_ids / ignore_eos / min_tokens, usage, the
stop-string rule, GetModelInfo, the bounds, and a sampled, penalised stream that stays token-exact when a stage is
killed mid-stream (the token history travels with the replay and the repair)."""

from __future__ import annotations

import grpc
import pytest
import torch

from stagemesh.v1 import router_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt

EOS = 1  # the tiny tokenizer's </s>
PATHS = ("forwarding",)


@pytest.fixture(scope="module")
async def meshes(tiny_model):
    started = {
        "forwarding": await start_mesh(tiny_model, [splits(3, 5)]),
    }
    yield started
    for mesh in started.values():
        await mesh.stop()


def request(ids: list[int], n: int, **kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=n, **kw)


async def generate(mesh, req: router_pb2.GenerateRequest) -> tuple[list[int], str, list]:
    return await collect(mesh.router_stub.Generate(req, timeout=60))


@pytest.mark.parametrize("path", PATHS)
async def test_logprobs_equal_transformers_log_softmax(meshes, hf_models, path):
    ids = prompt(12, seed=1)
    got, _, responses = await generate(meshes[path], request(ids, 8, logprobs=True, top_logprobs=5))
    assert got == hf_greedy(hf_models["llama"], ids, 8)
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    logprobs = [lp for r in responses for lp in r.logprobs]
    with torch.inference_mode():
        logits = hf_models["llama"](torch.tensor([ids + got])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    for k, lp in enumerate(logprobs):
        row = reference[len(ids) - 1 + k]
        assert lp.token_id == got[k]
        assert abs(lp.logprob - row[got[k]].item()) < 1e-4
        values, top_ids = torch.topk(row, 5)
        assert [t.token_id for t in lp.top] == top_ids.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(lp.top, values.tolist(), strict=True)) < 1e-4


@pytest.mark.parametrize("path", PATHS)
async def test_logprobs_of_a_sampled_token_are_of_the_raw_logits(meshes, hf_models, path):
    """Under temperature and top-k, the logprob is still log-softmax of the model's logits, not of the warped ones."""
    ids = prompt(9, seed=2)
    got, _, responses = await generate(meshes[path], request(ids, 6, temperature=0.7, top_k=20, seed=5,
                                                             logprobs=True))
    with torch.inference_mode():
        reference = torch.log_softmax(hf_models["llama"](torch.tensor([ids + got])).logits[0].float(), dim=-1)
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == got and all(not lp.top for lp in logprobs)
    for k, lp in enumerate(logprobs):
        assert abs(lp.logprob - reference[len(ids) - 1 + k, got[k]].item()) < 1e-4


@pytest.mark.parametrize("path", PATHS)
async def test_greedy_with_repetition_penalty_equals_transformers_generate(meshes, hf_models, path):
    hf = hf_models["llama"]
    for seed, penalty in ((3, 1.3), (4, 0.7), (5, 2.0)):
        ids = prompt(10, seed=seed) * 2  # a repeated prompt: the penalty has tokens to act on
        with torch.inference_mode():
            t = torch.tensor([ids])
            expected = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=24, do_sample=False,
                                   repetition_penalty=penalty)[0, len(ids):].tolist()
        got, _, _ = await generate(meshes[path], request(ids, 24, repetition_penalty=penalty))
        assert got == expected, penalty


@pytest.mark.parametrize("path", PATHS)
async def test_logit_bias_forces_a_token(meshes, path):
    ids = prompt(8, seed=6)
    greedy, _, _ = await generate(meshes[path], request(ids, 5, logit_bias={42: 100.0}))
    sampled, _, _ = await generate(meshes[path], request(ids, 5, temperature=1.0, seed=3, logit_bias={42: 100.0}))
    assert greedy == sampled == [42] * 5
    banned, _, _ = await generate(meshes[path], request(ids, 8, logit_bias={t: -100.0 for t in greedy[:1]}))
    assert greedy[0] not in banned


async def test_an_unset_seed_is_fresh_and_reported_and_reproduces_the_stream(meshes):
    mesh = meshes["forwarding"]
    ids = prompt(10, seed=7)
    runs = []
    for _ in range(2):
        got, _, responses = await generate(mesh, request(ids, 24, temperature=1.0))
        assert responses[0].HasField("seed") and not any(r.HasField("seed") for r in responses[1:])
        runs.append((got, responses[0].seed))
    (first, seed1), (second, seed2) = runs
    assert seed1 != seed2 and first != second
    for tokens, seed in runs:
        again, _, responses = await generate(mesh, request(ids, 24, temperature=1.0, seed=seed))
        assert again == tokens and responses[0].seed == seed
    assert 0 <= seed1 < 2**63 and 0 <= seed2 < 2**63


@pytest.mark.parametrize("path", PATHS)
async def test_stop_token_ids_end_the_stream_and_min_tokens_holds_them_back(meshes, path):
    mesh = meshes[path]
    ids = prompt(10, seed=8)
    plain, _, _ = await generate(mesh, request(ids, 16))
    stop = plain[3]
    first = plain.index(stop)
    got, _, responses = await generate(mesh, request(ids, 16, stop_token_ids=[stop]))
    assert got == plain[: first + 1]  # the stop id is returned
    assert responses[-1].finish_reason == router_pb2.FINISH_REASON_STOP
    held, _, responses = await generate(mesh, request(ids, 16, stop_token_ids=[stop], min_tokens=first + 2))
    assert stop not in held[: first + 2]  # suppressed before min_tokens
    assert held[: first] == plain[: first]
    assert responses[-1].finish_reason in (router_pb2.FINISH_REASON_STOP, router_pb2.FINISH_REASON_LENGTH)
    if responses[-1].finish_reason == router_pb2.FINISH_REASON_STOP:
        assert held[-1] == stop and len(held) > first + 2


@pytest.mark.parametrize("path", PATHS)
async def test_eos_ignore_eos_and_min_tokens(meshes, path):
    mesh = meshes[path]
    ids = prompt(10, seed=9)
    forced = {EOS: 100.0}  # the model's end-of-sequence token, every time
    got, _, responses = await generate(mesh, request(ids, 6, logit_bias=forced))
    assert got == [EOS] and responses[-1].finish_reason == router_pb2.FINISH_REASON_EOS
    got, _, responses = await generate(mesh, request(ids, 6, logit_bias=forced, ignore_eos=True))
    assert got == [EOS] * 6 and responses[-1].finish_reason == router_pb2.FINISH_REASON_LENGTH
    got, _, responses = await generate(mesh, request(ids, 6, logit_bias=forced, min_tokens=3))
    assert EOS not in got[:3] and got[3:] == [EOS] and responses[-1].finish_reason == router_pb2.FINISH_REASON_EOS
    # ignore_eos with a stop id that is the eos token: the stop id still ends it (finish "stop")
    got, _, responses = await generate(mesh, request(ids, 6, logit_bias=forced, ignore_eos=True,
                                                     stop_token_ids=[EOS]))
    assert got == [EOS] and responses[-1].finish_reason == router_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("path", PATHS)
async def test_usage_on_the_last_message_only(meshes, path):
    ids = prompt(11, seed=10)
    got, _, responses = await generate(meshes[path], request(ids, 7))
    assert not any(r.HasField("usage") for r in responses[:-1])
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, len(got)) == (11, 7)
    assert usage.cached_tokens == responses[-1].cached_tokens


async def test_at_a_stop_string_token_ids_and_text_end_at_the_same_place(meshes, tiny_model):
    """The token that completes the stop string is not returned, nor is any of its text: the text is the returned
    tokens' text, cut where the stop string begins."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    mesh = meshes["forwarding"]
    ids = prompt(10, seed=11)
    plain, plain_text, _ = await generate(mesh, request(ids, 24))
    checked = 0
    for a, b in ((6, 8), (10, 11), (3, 6)):  # stop strings cut from the plain text, at several places
        stop = plain_text[a:b]
        if not stop.strip() or plain_text.find(stop) != a:
            continue
        k = next(k for k in range(len(plain)) if stop in tokenizer.decode(plain[: k + 1], skip_special_tokens=True))
        got, text, responses = await generate(mesh, request(ids, 24, stop=[stop]))
        assert responses[-1].finish_reason == router_pb2.FINISH_REASON_STOP
        assert got == plain[:k]  # the completing token is not returned
        before = tokenizer.decode(plain[:k], skip_special_tokens=True)
        assert text == before[: min(a, len(before))]
        assert stop not in text and responses[-1].usage.completion_tokens == k
        checked += 1
    assert checked


async def test_get_model_info(meshes, tiny_model):
    mesh = meshes["forwarding"]
    info = await mesh.router_stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=10)
    assert info.model == tiny_model.name
    assert info.vocab_size == 1000 and info.context_length == mesh.router.service.max_position
    assert info.fingerprint and info.fingerprint == mesh.router.chains.chains[0].fingerprint
    assert not info.chat_template and list(info.eos_token_ids) == [EOS]


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {5000: 1.0}}, "outside the vocabulary"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {t: 1.0 for t in range(1025)}}, "at most 1024"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "needs logprobs"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [1000]}, "outside the vocabulary"),
    ({"stop_token_ids": list(range(65))}, "at most 64"),
]


@pytest.mark.parametrize(("fields", "says"), BAD, ids=[str(i) for i in range(len(BAD))])
async def test_out_of_range_fields_are_refused_with_a_clear_message(meshes, fields, says):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(meshes["forwarding"], request([5, 6, 7], 8, **fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.details()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["replay", "repair"])
async def test_a_sampled_penalised_stream_stays_exact_when_its_last_stage_is_killed(tiny_model, layout, path):
    """The last stage dies mid-stream: the stream moves (to a chain of another layout: a replay; to a stage of the
    same layers: a repair) and its tokens are those of an uninterrupted run, so the new last stage had the prompt
    and every generated token, by position."""
    chains = [splits(4, 4), splits(2, 6)] if layout == "replay" else [splits(4, 4), splits(4, 4)]
    mesh = await start_mesh(tiny_model, chains)
    try:
        stub = mesh.router_stub
        ids = prompt(6, seed=12) * 2
        fields = {"temperature": 0.8, "top_k": 50, "seed": 77, "repetition_penalty": 1.5,
                  "presence_penalty": 0.8, "frequency_penalty": 0.6, "min_p": 0.02}
        first, _, _ = await collect(stub.Generate(request(ids, 40, **fields), timeout=60))
        second, _, _ = await collect(stub.Generate(request(ids, 40, **fields), timeout=60))
        unpenalised, _, _ = await collect(stub.Generate(request(ids, 40, temperature=0.8, top_k=50, seed=77),
                                                        timeout=60))
        assert first == second and first != unpenalised
        got = []
        async for r in stub.Generate(request(ids, 40, **fields), timeout=60):
            got.extend(r.token_ids)
            if len(got) == 15:  # kill the last stage of the chain carrying it
                busy = [c for c, chain in enumerate(mesh.stages) if len(chain[-1].sessions)]
                await mesh.stages[busy[0]][-1].stop(0)
        assert got == first
    finally:
        await mesh.stop()
