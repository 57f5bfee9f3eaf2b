"""Packed weights (on by default): every Linear of a CPU float32 stage holds its weight as panels of 16 output
columns, multiplied by stagemesh::packed_linear (stage_server/cpu/packed_weights.py, packed_linear.cpp). Exact as
before: greedy tokens identical to transformers and logits within 1e-4, for every family, in one stage and
split, under batched decode passes and prefill chunks; a tied LM head keeps sharing the embeddings' weight; the
RMSNorm before a packed Linear runs inside its call."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.stage_server.cpu import cpu_kernels, packed_weights
from stagemesh.stage_server.engine import paged_attention
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.model import RMSNorm
from stagemesh.stage_server.engine.quantize import Int8WeightLinear
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import router_pb2
from tests.conftest import (
    FAMILIES,
    collect,
    decode_passes_match_transformers,
    hf_greedy,
    splits,
    start_mesh,
    stepped_logits,
)
from tests.test_exactness import prompt

if not cpu_kernels.load():
    pytest.skip("the CPU kernels could not be built here (tests/test_paged_attention.py says why)",
                allow_module_level=True)


def linears(model) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, packed_weights.PackedLinear))]


@pytest.mark.parametrize("shape", [(100, 64, True), (48, 33, False), (16, 1, True), (3, 40, False), (50, 700, True)],
                         ids=["padded-panel", "odd-features", "one-feature", "less-than-a-panel", "several-slices"])
def test_a_packed_linear_is_the_linear_for_any_shape_and_rows(shape):
    """Outputs not a multiple of 16 (the last panel padded), any number of input features, with and without
    bias, from 0 rows to more than one chunk of 64, in 2-D and 3-D: within float32 rounding of the product in
    float64."""
    out_features, in_features, bias = shape
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    packed = packed_weights.PackedLinear(linear)
    assert packed.panels.shape == (-(-out_features // 16), in_features, 16)
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 5, 6, 7, 13, 64, 70, 131):
            x = torch.randn(rows, in_features)
            ref = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                             None if linear.bias is None else linear.bias.double())
            torch.testing.assert_close(packed(x).double(), ref, atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 5, in_features)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(100, 64, True), (48, 33, False), (3, 40, False), (50, 700, True)],
                         ids=["padded-panel", "odd-features", "less-than-a-panel", "several-slices"])
def test_int8_panels_compute_what_the_int8_linear_computes(shape):
    """--quantize int8-weight-only on a CPU float32 stage: the int8 weights and their scales in panels, widened as
    the kernel reads them, equal Int8WeightLinear (which widens the whole weight per call) within float32 rounding,
    for every pass shape the float panels take; the panels hold a byte per weight and the scales."""
    out_features, in_features, bias = shape
    torch.manual_seed(out_features + in_features)
    int8 = Int8WeightLinear(nn.Linear(in_features, out_features, bias=bias))
    packed = packed_weights.PackedLinear(int8)
    count = -(-out_features // 16)
    assert packed.panels.dtype == torch.int8 and packed.panels.shape == (count, in_features + 4, 16)
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 5, 6, 7, 13, 64, 70, 131):
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(packed(x), int8(x), atol=1e-5, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_rest_of_its_pass():
    """Each output is one chain of multiply-adds in input order, however the pass is blocked and its inputs
    sliced: a row alone and the same row anywhere in passes of 2 to 131 rows (every block size and split, of 6 rows
    at most with 8-float vectors and of 14 with 16-float ones, panels one or two at a time (13 of them: an odd one
    left), 300 inputs in two slices, and past a chunk) come out bit for bit the same."""
    torch.manual_seed(3)
    packed = packed_weights.PackedLinear(nn.Linear(300, 200))
    row = torch.randn(1, 300)
    with torch.inference_mode():
        alone = packed(row)
        for rows in (*range(2, 18), 28, 29, 33, 48, 64, 70, 131):
            for at in (0, rows // 2, rows - 1):
                x = torch.randn(rows, 300)
                x[at] = row[0]
                assert torch.equal(packed(x)[at], alone[0]), (rows, at)


def test_the_norm_inside_the_linear_is_the_norm_then_the_linear():
    """With the RMSNorm before it taken in, a packed Linear computes norm then product: within float32 rounding
    of F.rms_norm followed by the Linear in float64, for 1 row to more than a chunk, rows of any scale (a row of
    zeros too: eps keeps it finite); and a row's result still does not depend on its pass."""
    torch.manual_seed(7)
    linear, norm = nn.Linear(96, 40), RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    packed = packed_weights.PackedLinear(linear)
    assert isinstance(packed.take_norm(norm), packed_weights.NormInNextLinear)
    with torch.inference_mode():
        for rows in (1, 2, 6, 64, 70):
            x = torch.randn(rows, 96) * torch.logspace(-3, 3, rows)[:, None]
            x[0] = 0.0
            ref = torch.nn.functional.linear(F.rms_norm(x.double(), (96,), norm.weight.double(), 1e-5),
                                             linear.weight.double(), linear.bias.double())
            out = packed(x)
            assert out.isfinite().all()
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
            assert torch.equal(packed(x[-1:])[0], out[-1])


def test_pack_moves_each_norm_into_the_linear_after_it(tiny_model, tmp_path):
    """Each decoder layer's two norms go into the qkv and gate/up Linears, the final norm into an untied LM head;
    what stays in the norms' place passes its input through and keeps the weight (the model's dtype is read off
    it). A tied LM head is not packed, so the final norm before it stays a norm."""
    model = load_stage(tiny_model, 0, None)
    packed_weights.pack(model)
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.norm_weight is layer.input_layernorm.weight
    assert layer.mlp.gate_up_proj.norm_weight is layer.post_attention_layernorm.weight
    assert model.lm_head.norm_weight is model.norm.weight
    assert layer.self_attn.o_proj.norm_weight is None and layer.mlp.down_proj.norm_weight is None
    assert model.dtype == torch.float32
    tied = load_stage(make_tiny_model(tmp_path / "tied", "llama", layers=2, tie_word_embeddings=True), 0, None)
    packed_weights.pack(tied)
    assert isinstance(tied.norm, RMSNorm)
    assert isinstance(tied.layers[1].input_layernorm, packed_weights.NormInNextLinear)


def test_the_panels_replace_the_weight(tiny_model):
    """pack() leaves no Linear with its loaded weight: the panels are the only copy, the weight's bytes plus at most
    15 zero columns each (the tiny model's vocabulary is not a multiple of 16)."""
    model = load_stage(tiny_model, 0, None)
    plain = sum(p.nbytes for p in model.parameters())
    shapes = [m.weight.shape for m in linears(model)]
    padding = sum(15 * k * 4 for _, k in shapes)
    packed = packed_weights.pack(model)
    assert all(isinstance(m, packed_weights.PackedLinear) and not hasattr(m, "weight") for m in linears(model))
    assert sum(n * k * 4 for n, k in shapes) <= packed <= sum(n * k * 4 for n, k in shapes) + padding
    assert plain <= sum(p.nbytes for p in model.parameters()) <= plain + padding


def test_a_tied_lm_head_keeps_sharing_the_embeddings(tmp_path):
    """A checkpoint with tied embeddings: its LM head reads the embedding matrix, which the stage needs as it is;
    packing that head would hold the matrix twice, so it stays a Linear over the shared weight."""
    model = load_stage(make_tiny_model(tmp_path / "tied", "llama", layers=2, tie_word_embeddings=True), 0, None)
    packed_weights.pack(model)
    assert isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert isinstance(model.layers[0].mlp.down_proj, packed_weights.PackedLinear)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_passes_with_packed_weights_match_transformers(tiny_models, hf_models, family):
    """The whole model in one stage, in process: four sessions of 1-17 prompt tokens prefilled in one pass, then
    decoded together in passes of 1 to 4 of them. Every step's logits within 1e-4 of transformers' forward pass,
    greedy tokens the same."""
    model = load_stage(tiny_models[family], 0, None)
    paged_attention.attach(model)
    packed_weights.pack(model)
    assert all(isinstance(m, packed_weights.PackedLinear) for m in linears(model))
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    seqs = [prompt(n, seed=60 + n) for n in (1, 5, 9, 17)]  # one prefill pass of 32 tokens
    batches = [[0, 1, 2, 3][: (4, 1, 3, 2)[k % 4]] for k in range(12)]
    decode_passes_match_transformers(model, hf_models[family], pool, seqs, batches)


def test_only_float32_cpu_weights_are_packed(tiny_model):
    bf16 = load_stage(tiny_model, 0, 1, dtype=torch.bfloat16)
    assert "bfloat16" in packed_weights.available(bf16)
    assert packed_weights.available(load_stage(tiny_model, 0, 1)) is None


@pytest.mark.parametrize("options", [{"quantize": "int8"}, {"packed_weights": False}], ids=["int8", "off"])
async def test_stages_that_hold_their_linears_otherwise_keep_them(tiny_model, options):
    """--quantize int8 keeps torch.ao's int8 Linears, --no-packed-weights torch's; each stage still serves."""
    mesh = await start_mesh(tiny_model, [splits(3, 5)], stage_options=options)
    try:
        for stage in mesh.all_stages():
            assert not any(isinstance(m, packed_weights.PackedLinear) for m in stage.model.modules())
        tokens, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[1, 2, 3],
                                                                                          max_new_tokens=4)))
        assert len(tokens) == 4
    finally:
        await mesh.stop()


@pytest.mark.parametrize(("family", "packed"), [*((f, True) for f in FAMILIES), ("llama", False)],
                         ids=[*FAMILIES, "llama-unpacked"])
async def test_a_split_is_exact_under_concurrent_streams(tiny_models, hf_models, family, packed):
    """A 2-stage split served over gRPC, packed (the default) and not: 8 concurrent streams (batched decode
    passes, prefill chunks of several prompts) each equal transformers' generate(), and one stream's logits within
    1e-4 of its forward pass."""
    mesh = await start_mesh(tiny_models[family], [splits(3, 5)], stage_options={"packed_weights": packed})
    try:
        for stage in mesh.all_stages():
            assert all(isinstance(m, packed_weights.PackedLinear) == packed for m in linears(stage.model))
            assert (stage.model.decode_layers is not None) == packed  # a layer per call needs the panels
        prompts = [prompt(8 + 13 * i, seed=300 + i) for i in range(8)]
        expected = [hf_greedy(hf_models[family], p, 24) for p in prompts]
        results = await asyncio.gather(*(collect(mesh.router_stub.Generate(
            router_pb2.GenerateRequest(token_ids=p, max_new_tokens=24))) for p in prompts))
        assert [r[0] for r in results] == expected
        ids = prompt(16, seed=41)
        tokens, logits = await stepped_logits([s.address for s in mesh.stages[0]], ids, 6, "packed-test")
        with torch.inference_mode():
            ref = hf_models[family](torch.tensor([ids + tokens])).logits[0]
        for k, row in enumerate(logits):
            torch.testing.assert_close(row, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)
    finally:
        await mesh.stop()
