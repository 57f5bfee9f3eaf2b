"""Exactness on a chosen device and dtype (`pytest --device cuda --test-dtype bfloat16 --test-model DIR`, as
scripts/gpu_check.sh runs it on a GPU): a 2-stage chain on that device against transformers on the same device
in the same dtype. By default (cpu, float32, the tiny Llama) it is one more float32 check."""

from __future__ import annotations

import pytest
import torch

from router.chain_client import Chain, ChainSession, Sampling, StageEndpoint
from stagemesh import tensor_codec
from stagemesh.v1 import router_pb2
from tests.conftest import collect, start_mesh
from tests.test_exactness import prompt

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}
"""Logits: float32 as everywhere; bfloat16 to its rounding (the same bound as the CPU bfloat16 test)."""


@pytest.fixture(scope="module")
def target(request, tiny_model):
    device, dtype = request.config.getoption("--device"), request.config.getoption("--test-dtype")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"--device {device} but torch sees no CUDA device")
    return device, dtype, request.config.getoption("--test-model") or str(tiny_model)


async def test_two_stage_chain_matches_transformers_on_the_device(target):
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype, model = target
    config = AutoConfig.from_pretrained(model, local_files_only=True)
    layers, vocab = config.num_hidden_layers, config.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    half = layers // 2
    mesh = await start_mesh(model, [[(0, half), (half, layers)]], stage_options={"device": device, "dtype": dtype})
    try:
        ids = [i % vocab for i in prompt(24, seed=11)]
        chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
        async with ChainSession(chain, max_length=64, request_id="device-test") as session:
            response = await session.step(ids, sampling=Sampling(), return_logits=True)
        for stage in chain.stages:
            await stage.close()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        torch.testing.assert_close(tensor_codec.decode(response.logits), ref, atol=TOLERANCE[dtype], rtol=0)
        with torch.inference_mode():
            ids_t = torch.tensor([ids], device=device)
            out = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=16, do_sample=False)
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=16)))
        assert got == out[0, len(ids):].tolist()
    finally:
        await mesh.stop()
