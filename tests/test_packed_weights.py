"""--packed-weights: every Linear of a CPU float32 stage also holds its weight in oneDNN's layout and multiplies
passes of several tokens by it (stage_server/packed_weights.py), single rows by the weight as loaded. Exact as
before: greedy tokens identical to transformers and logits within 1e-4, for every family, in one stage and
split, under batched decode passes and prefill chunks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from stage_server import packed_weights, paged_attention
from stage_server.config import StageConfig
from stage_server.kv_pool import KVPool
from stage_server.loader import load_stage
from stage_server.model import StepSlice
from stagemesh.v1 import router_pb2
from tests.conftest import FAMILIES, collect, hf_greedy, splits, start_mesh, stepped_logits
from tests.test_exactness import prompt


def linears(model) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, packed_weights.PackedLinear))]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_passes_with_packed_weights_match_transformers(tiny_models, hf_models, family):
    """The whole model in one stage, in process: four sessions of 1-17 prompt tokens prefilled in one pass, then
    decoded together in passes of 1 to 4 of them. Every step's logits within 1e-4 of transformers' forward pass,
    greedy tokens the same."""
    model = load_stage(tiny_models[family], 0, None)
    paged_attention.attach(model)
    plain = len(linears(model))
    added = packed_weights.pack(model)
    assert added == sum(m.weight.nbytes for m in linears(model)) > 0
    assert len(linears(model)) == plain and all(isinstance(m, packed_weights.PackedLinear) for m in linears(model))
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    seqs = [prompt(n, seed=60 + n) for n in (1, 5, 9, 17)]
    caches = [pool.allocate(64) for _ in seqs]
    steps, offset = [], 0
    for cache, ids in zip(caches, seqs, strict=True):
        pool.grow(cache, len(ids))
        steps.append(StepSlice(cache, offset, 0, len(ids)))
        offset += len(ids)
    out = model(torch.tensor([t for ids in seqs for t in ids]), steps)  # one prefill pass of 32 tokens
    hf = hf_models[family]
    with torch.inference_mode():
        for ids, row in zip(seqs, out, strict=True):
            torch.testing.assert_close(row, hf(torch.tensor([ids])).logits[0, -1], atol=1e-4, rtol=0)
            ids.append(int(row.argmax()))
        for k in range(12):
            batch = [0, 1, 2, 3][: (4, 1, 3, 2)[k % 4]]
            steps = []
            for i, s in enumerate(batch):
                pool.grow(caches[s], caches[s].length + 1)
                steps.append(StepSlice(caches[s], i, caches[s].length, 1))
            out = model(torch.tensor([seqs[s][-1] for s in batch]), steps)
            for s, row in zip(batch, out, strict=True):
                ref = hf(torch.tensor([seqs[s]])).logits[0, -1]
                torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)
                assert int(row.argmax()) == int(ref.argmax())
                seqs[s].append(int(row.argmax()))


def test_several_rows_go_through_the_packed_copy_and_one_row_through_the_weight(tiny_model):
    """Which copy each pass reads: with the packed copy of one Linear replaced by zeros' (not a packing of its
    weight), a pass of 3 rows comes out zero and a single row still equals the plain product."""
    model = load_stage(tiny_model, 0, 1)
    packed_weights.pack(model)
    layer = model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.weight.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), atol=1e-5, rtol=0)
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(layer.weight), None)
        assert layer(x).abs().max() == 0
        torch.testing.assert_close(layer(x[:1]), x[:1] @ layer.weight.t(), atol=1e-5, rtol=0)


def test_only_float32_cpu_weights_are_packed(tiny_model):
    bf16 = load_stage(tiny_model, 0, 1, dtype=torch.bfloat16)
    assert "bfloat16" in packed_weights.available(bf16)
    assert packed_weights.available(load_stage(tiny_model, 0, 1)) is None


@pytest.mark.parametrize("other", [{"compile": True}, {"quantize": "int8"}, {"tp": 2}])
def test_packed_weights_are_refused_with_layers_of_their_own(tiny_model, other):
    with pytest.raises(ValueError, match="--packed-weights.*--quantize, --compile or --tp"):
        StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, packed_weights=True, **other)


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_split_with_packed_weights_is_exact_under_concurrent_streams(tiny_models, hf_models, family):
    """A 2-stage split served over gRPC with --packed-weights: 8 concurrent streams (batched decode passes, prefill
    chunks of several prompts) each equal transformers' generate(), and one stream's logits within 1e-4 of its
    forward pass."""
    mesh = await start_mesh(tiny_models[family], [splits(3, 5)], stage_options={"packed_weights": True})
    try:
        for stage in mesh.all_stages():
            assert all(isinstance(m, packed_weights.PackedLinear) for m in linears(stage.model))
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
