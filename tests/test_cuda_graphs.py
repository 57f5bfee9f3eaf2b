"""--cuda-graphs: decode passes replayed from CUDA graphs captured per padded bucket (stage_server/cuda_graphs.py).

What a machine without a GPU can check: the padding. The same buckets and buffers, run through the decode pass
without a graph (capture=False), give every session the logits transformers gives it (1e-4) while padding rows
write into the null block and padded key blocks hold NaN; a pass past the largest bucket runs eager; a stage not
on CUDA serves eager and says so; the flag is refused beside --compile. On a CUDA machine (scripts/gpu_check.sh)
the same passes replay captured graphs."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from stage_server.config import StageConfig
from stage_server.cuda_graphs import GraphedDecode, bucket, powers_of_two
from stage_server.kv_pool import KVPool
from stage_server.loader import load_stage
from stage_server.model import StepSlice
from stagemesh.v1 import router_pb2
from tests.conftest import collect, decode_passes_match_transformers, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device: graphs are not captured here"))]


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert powers_of_two(1, 128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert powers_of_two(2, 5) == [2, 4, 8]
    assert bucket(3, [1, 2, 4]) == 4 and bucket(4, [1, 2, 4]) == 4 and bucket(5, [1, 2, 4]) is None


@pytest.mark.parametrize("device", DEVICES)
def test_padded_decode_passes_match_transformers(tiny_models, device):
    """The whole tiny Llama in one stage: sessions of 1-17 positions in 4-position blocks decoded together in
    passes of 1-3 of them, padded to buckets of 1, 2 and 4 rows (a pass of 3 carries a padding row) and to
    2, 4, 8 ... key blocks. Every step's logits within 1e-4 of transformers' forward pass and greedy tokens the
    same, with every pool slot no session wrote set to NaN: a padding row that wrote into a session's block, or a
    padded key that was read, would show."""
    path = tiny_models["llama"]
    model = load_stage(path, 0, None, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, device, block_size=4)
    pool.k[:, pool.block_size:] = float("nan")
    pool.v[:, pool.block_size:] = float("nan")
    graphed = GraphedDecode(model, pool, max_batch=4, capture=device == "cuda")
    graphed.capture_all()
    assert graphed.batches == [1, 2, 4] and graphed.widths[0] == 2
    assert len(graphed.captured) == len(graphed.batches) * len(graphed.widths)
    model.decode_graph = graphed
    seqs = [prompt(n, seed=80 + n) for n in (1, 5, 9, 17)]
    # passes of 3 rows carry one padding row in the 4-row bucket; each pass through the padded buffers
    batches = [[[3, 0, 2], [1], [2, 3], [0, 1, 3]][k % 4] for k in range(12)]
    caches = decode_passes_match_transformers(model, hf, pool, seqs, batches, device)
    assert max(c.length for c in caches) > 4 * pool.block_size  # past 4 blocks: the 8-block bucket was used


def test_a_pass_past_the_largest_bucket_has_no_graph(tiny_models):
    """A pass of 3 sessions where the largest bucket holds 2: no graph (the stage runs it eager)."""
    model = load_stage(tiny_models["llama"], 0, None)
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    graphed = GraphedDecode(model, pool, max_batch=2, capture=False)
    graphed.capture_all()
    caches = [pool.allocate(8) for _ in range(3)]
    for cache in caches:
        pool.grow(cache, 1)
    steps = [StepSlice(cache, i, 0, 1) for i, cache in enumerate(caches)]
    assert graphed(torch.zeros(3, dtype=torch.long), steps) is None
    assert graphed(torch.zeros(2, dtype=torch.long), steps[:2]).shape == (2, a.vocab_size)


def test_cuda_graphs_are_refused_with_compile(tiny_model):
    with pytest.raises(ValueError, match="--cuda-graphs.*--compile"):
        StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, cuda_graphs=True, compile=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a stage without CUDA")
async def test_a_stage_not_on_cuda_serves_eager(tiny_models, hf_models, caplog):
    """--cuda-graphs on a CPU stage: the warm-up says why there are no graphs, and the chain serves exactly."""
    caplog.set_level(logging.WARNING, logger="stagemesh.stage")
    mesh = await start_mesh(tiny_models["llama"], [splits(4, 4)], stage_options={"cuda_graphs": True})
    try:
        assert all(s.model.decode_graph is None for s in mesh.all_stages())
        assert "--cuda-graphs: the stage is on cpu, not CUDA; serving eager" in caplog.text
        ids = prompt(12, seed=5)
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=8)))
        assert got == hf_greedy(hf_models["llama"], ids, 8)
    finally:
        await mesh.stop()
