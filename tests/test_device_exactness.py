"""Exactness on a chosen device and dtype (`pytest --device cuda --test-dtype bfloat16 --test-model DIR`, as
scripts/gpu_check.sh runs it on a GPU): a 2-stage chain on that device against transformers on the same device
in the same dtype, eager (--enforce-eager) and (on CUDA) with CUDA graphs. By default (cpu, float32, the tiny
Llama) it is one more float32 check."""

from __future__ import annotations

import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.v1 import router_pb2
from tests.conftest import collect, start_mesh
from tests.test_exactness import prompt

TOLERANCE = {"float32": (1e-4, 0.0), "bfloat16": (0.05, 2**-6)}
"""Logits (absolute, relative): float32 as everywhere; bfloat16 to its rounding: the CPU bfloat16 test's 0.05, and
two bfloat16 steps of the logit's own size, since a deep model's logits grow past where 0.05 is one step."""


def agreed(got: list[int], ref: list[int], scores: list[torch.Tensor], atol: float) -> int:
    """How many of ref's greedy tokens got repeats before the first it does not; a token that differs is allowed
    only where transformers' own top two logits were closer than atol: where the two sides' rounding may
    pick either. Returns the count of leading tokens equal."""
    n = next((i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r), len(ref))
    if n < len(ref):
        top2 = scores[n].float().topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < atol, f"token {n}: {got[n]} where transformers chose {ref[n]} by a margin of {gap:.4f}"
    return n


@pytest.fixture(scope="module")
def target(request, tiny_model):
    device, dtype = request.config.getoption("--device"), request.config.getoption("--test-dtype")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"--device {device} but torch sees no CUDA device")
    return device, dtype, request.config.getoption("--test-model") or str(tiny_model)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
async def test_two_stage_chain_matches_transformers_on_the_device(target, graphs):
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype, model = target
    if graphs and not device.startswith("cuda"):
        pytest.skip("CUDA graphs are captured on a CUDA device (--device cuda); tests/triton_interpreted.py checks "
                    "their padding here")
    atol, rtol = TOLERANCE[dtype]
    config = AutoConfig.from_pretrained(model, local_files_only=True)
    layers, vocab = config.num_hidden_layers, config.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    half = layers // 2
    mesh = await start_mesh(model, [[(0, half), (half, layers)]],
                            stage_options={"device": device, "dtype": dtype, "enforce_eager": not graphs})
    try:
        if graphs:
            assert all(s.model.pass_graphs is not None for s in mesh.all_stages()), "a capture failed: see the log"
        ids = [i % vocab for i in prompt(24, seed=11)]
        chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
        async with ChainSession(chain, max_length=64, request_id="device-test") as session:
            response = await session.step(ids, sampling=Sampling(), return_logits=True)
        for stage in chain.stages:
            await stage.close()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        torch.testing.assert_close(tensor_codec.decode(response.logits), ref, atol=atol, rtol=rtol)
        with torch.inference_mode():
            ids_t = torch.tensor([ids], device=device)
            out = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=16, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=16)))
        ref_tokens = out.sequences[0, len(ids):].tolist()
        n = agreed(got, ref_tokens, [s[0] for s in out.scores], atol)
        print(f"{device} {dtype} {'cuda-graphs' if graphs else 'eager'}: {n} of {len(ref_tokens)} greedy tokens "
              f"equal to transformers'")
        if dtype == "float32":
            assert n == len(ref_tokens)
    finally:
        await mesh.stop()
