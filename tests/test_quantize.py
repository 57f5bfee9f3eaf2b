"""int8 weights: the stage serves, with logits close to float32's (the full accuracy report is
scripts/bench_levers.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagemesh import tensor_codec
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.cpu import cpu_kernels
from stagemesh.stage_server.cpu.packed_weights import PackedLinear
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.quantize import FP8, Fp8Linear, Int8WeightLinear, fp8_rows, quantize
from stagemesh.v1 import router_pb2
from tests.conftest import collect, splits, start_mesh


async def last_logits(mesh, ids: list[int]) -> torch.Tensor:
    chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
    try:
        async with ChainSession(chain, 64, "quantize-test") as session:
            response = await session.step(ids, sampling=Sampling(), return_logits=True)
            return tensor_codec.decode(response.logits)
    finally:
        for s in chain.stages:
            await s.close()


@pytest.mark.parametrize("how", ["int8", "int8-weight-only"])
async def test_int8_stage_serves_logits_close_to_float32(tiny_model, how):
    ids = list(range(10, 40))
    logits = {}
    for option in ("none", how):
        mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False, stage_options={"quantize": option})
        try:
            logits[option] = await last_logits(mesh, ids)
        finally:
            await mesh.stop()
    assert (logits[how] - logits["none"]).abs().max() < 0.2
    assert not torch.equal(logits[how], logits["none"])  # it really ran quantized


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels could not be built here "
                                                  "(tests/test_paged_attention.py says why)")
async def test_int8_weight_only_on_cpu_float32_serves_from_int8_panels(tiny_model):
    """A CPU float32 stage with --quantize int8-weight-only packs its int8 weights for stagemesh's kernel (a byte
    per weight, every Linear, the untied head's int8 copy too) and serves what the unpacked Int8WeightLinears
    compute: greedy tokens equal, logits within 1e-4."""
    logits, tokens = {}, {}
    for packed in (True, False):
        mesh = await start_mesh(tiny_model, [splits(3, 5)], stage_options={"quantize": "int8-weight-only",
                                                                            "packed_weights": packed})
        try:
            for stage in mesh.all_stages():
                held = [m for m in stage.model.modules() if isinstance(m, (PackedLinear, Int8WeightLinear, nn.Linear))]
                assert {type(m) for m in held} == ({PackedLinear} if packed else {Int8WeightLinear})
                assert all(m.panels.dtype == torch.int8 for m in held if packed)
            logits[packed] = await last_logits(mesh, list(range(10, 40)))
            tokens[packed], _, _ = await collect(mesh.router_stub.Generate(
                router_pb2.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=12)))
        finally:
            await mesh.stop()
    assert tokens[True] == tokens[False] and len(tokens[True]) == 12
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=0)


def test_int8_off_cpu_float32_keeps_int8_weights_and_a_scale_per_output_channel(tiny_model):
    """bfloat16 (and CUDA) take the weight-only path: torch.ao's int8 kernels are CPU/float32 only."""
    full = load_stage(tiny_model, 0, 8, dtype=torch.bfloat16)
    reference = full.layers[0].mlp.down_proj.weight.detach().float().clone()
    before = sum(p.nbytes for p in full.parameters())
    model = quantize(full, "int8")
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, Int8WeightLinear) and down.weight.dtype == torch.int8
    assert down.scale.shape == (reference.shape[0],)
    assert (down.weight.float() * down.scale.float()[:, None] - reference).abs().max() <= down.scale.float().max()
    assert sum(p.nbytes for p in model.parameters()) < 0.7 * before  # int8 weights: half of bfloat16's bytes
    x = torch.randn(3, reference.shape[1], dtype=torch.bfloat16)
    assert down(x).dtype == torch.bfloat16
    dequantized = down.weight.float() * down.scale.float()[:, None]
    torch.testing.assert_close(down(x).float(), x.float() @ dequantized.t(), rtol=0.02, atol=0.02)


def test_unknown_quantization_says_what_to_use(tiny_model):
    with pytest.raises(ValueError, match="int8-weight-only"):
        quantize(load_stage(tiny_model, 0, 8), "int4")


def test_int8_loaded_weights_equal_converted_ones(tiny_model):
    loaded = load_stage(tiny_model, 0, 8, dtype=torch.bfloat16, linears="int8")
    converted = quantize(load_stage(tiny_model, 0, 8, dtype=torch.bfloat16), "int8")
    assert set(dict(loaded.named_parameters())) == set(dict(converted.named_parameters()))
    for name, p in loaded.named_parameters():
        assert torch.equal(p, converted.get_parameter(name)), name


def test_float16_int8_weights_stay_finite_with_large_activations():
    """The scale is applied to the weight before the product: raw int8 values times outlier
    activations would overflow float16."""
    linear = torch.nn.Linear(2816, 64, bias=False).half()
    x = torch.zeros(1, 2816, dtype=torch.float16)
    x[0, :64] = 300.0
    out = Int8WeightLinear(linear)(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), x.float() @ linear.weight.float().t(), rtol=0.02, atol=0.5)


async def test_fp8_stage_serves_logits_close_to_float32_from_fp8_weights(tiny_model):
    """--quantize fp8 on a CPU stage (torch's FP8 kernel stands in for Hopper's): every Linear an Fp8Linear holding
    float8_e4m3 weights, logits close to float32's but not equal (it really ran in FP8)."""
    ids = list(range(10, 40))
    logits = {}
    for option in ("none", "fp8"):
        mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False, stage_options={"quantize": option})
        try:
            if option == "fp8":
                for stage in mesh.all_stages():
                    held = [m for m in stage.model.modules() if isinstance(m, (Fp8Linear, nn.Linear))]
                    assert held and all(isinstance(m, Fp8Linear) and m.weight.dtype == FP8 for m in held)
                    assert stage.fingerprint.rsplit("/", 1)[0].endswith("/fp8")
            logits[option] = await last_logits(mesh, ids)
        finally:
            await mesh.stop()
    assert (logits["fp8"] - logits["none"]).abs().max() < 0.3
    assert not torch.equal(logits["fp8"], logits["none"])


def test_fp8_rows_round_trip_within_fp8_precision():
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different magnitudes
    q, scale = fp8_rows(w, torch.float32)
    assert q.dtype == FP8 and scale.shape == (64,)
    back = q.float() * scale[:, None]
    assert ((back - w).abs() <= w.abs().amax(1, keepdim=True) * 2**-3).all()  # e4m3: 3 mantissa bits
