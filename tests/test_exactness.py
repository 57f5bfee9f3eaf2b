"""Greedy tokens and logits through chains of 1-4 stages equal transformers' on the whole model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.v1 import router_pb2
from tests.conftest import FAMILIES, collect, hf_greedy, splits, start_mesh, stepped_logits

LAYOUTS = {
    1: splits(8),
    2: splits(4, 4),
    3: splits(1, 3, 4),  # uneven
    4: splits(2, 1, 4, 1),  # uneven
}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
async def meshes(tiny_models):
    """One router per (family, stage count), each over its own chain."""
    started = {}
    for family in FAMILIES:
        for n, layout in LAYOUTS.items():
            started[family, n] = await start_mesh(tiny_models[family], [layout])
    yield started
    for mesh in started.values():
        await mesh.stop()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_stages", sorted(LAYOUTS))
async def test_greedy_tokens_equal_transformers(meshes, hf_models, family, n_stages):
    ids = prompt(24, seed=n_stages)
    expected = hf_greedy(hf_models[family], ids, 32)
    stub = meshes[family, n_stages].router_stub
    got, _, responses = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=32)))
    assert got == expected
    assert responses[-1].finish_reason in (router_pb2.FINISH_REASON_LENGTH, router_pb2.FINISH_REASON_EOS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_stages", sorted(LAYOUTS))
async def test_last_stage_logits_match_transformers(meshes, hf_models, family, n_stages):
    mesh = meshes[family, n_stages]
    ids = prompt(16, seed=100 + n_stages)
    new, got_logits = await stepped_logits([s.address for s in mesh.stages[0]], ids, 8, "logits-test")
    tokens = ids + new
    with torch.inference_mode():
        ref = hf_models[family](torch.tensor([tokens])).logits[0]  # [len, vocab]
    for k, logits in enumerate(got_logits):
        torch.testing.assert_close(logits, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)


async def test_long_prompt_is_exact(meshes, hf_models):
    ids = prompt(600, seed=5)
    expected = hf_greedy(hf_models["qwen2"], ids, 32)
    got, _, _ = await collect(meshes["qwen2", 3].router_stub.Generate(
        router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=32)))
    assert got == expected


@pytest.mark.parametrize("family", FAMILIES)
async def test_concurrent_requests_through_one_chain_are_exact(meshes, hf_models, family):
    prompts = [prompt(8 + 13 * i, seed=200 + i) for i in range(8)]
    expected = [hf_greedy(hf_models[family], p, 24) for p in prompts]
    stub = meshes[family, 2].router_stub
    results = await asyncio.gather(*(
        collect(stub.Generate(router_pb2.GenerateRequest(token_ids=p, max_new_tokens=24))) for p in prompts))
    assert [r[0] for r in results] == expected


async def test_text_prompt_streams_text_that_decodes_the_tokens(meshes, tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    stub = meshes["llama", 2].router_stub
    ids, text, responses = await collect(stub.Generate(
        router_pb2.GenerateRequest(prompt="The quick brown fox", max_new_tokens=20)))
    assert len(responses) >= 2  # streamed, not one message at the end
    assert text == tok.decode(ids, skip_special_tokens=True)


async def test_bfloat16_chain_follows_transformers_in_bfloat16(tiny_models):
    """Both sides compute in bfloat16 (weights in their row-major layout, as transformers has them); the
    logits agree to bfloat16's rounding (they are identical today) and so do the greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = tiny_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = prompt(24, seed=7)
    mesh = await start_mesh(model, [splits(4, 4)], stage_options={"dtype": "bfloat16"})
    try:
        chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
        async with ChainSession(chain, max_length=64, request_id="bf16-test") as session:
            response = await session.step(ids, sampling=Sampling(), return_logits=True)
        await chain.stages[0].close()
        await chain.stages[1].close()
        got = tensor_codec.decode(response.logits)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got, ref, atol=0.05, rtol=0)
        expected = hf_greedy(hf, ids, 16)
        tokens, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                          max_new_tokens=16)))
        assert tokens == expected
    finally:
        await mesh.stop()
