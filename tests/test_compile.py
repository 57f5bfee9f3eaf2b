"""--compile: a stage's decode passes run as one compiled graph (stage_server/engine/compiled.py) and stay exact:
greedy tokens identical to transformers and logits within 1e-4 in float32, for Llama, Mistral with a sliding
window and Qwen2 (biases), a whole model in one stage and a 2-stage split; batched decode passes of sessions of
different lengths; no recompilation once warmed up; a compilation that fails leaves the stage serving eager.
Marked `compile`: each stage compiles two graphs in its warm-up (5-30 s a stage on 2 busy cores)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.config as inductor_config
from transformers import AutoModelForCausalLM

from stagemesh.stage_server import server as server_module
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.cpu import cpu_kernels, packed_weights
from stagemesh.stage_server.engine import paged_attention
from stagemesh.stage_server.engine.compiled import compile_stage, compiled_graphs, is_compiled, warm_up_decode
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import router_pb2
from tests.conftest import collect, decode_passes_match_transformers, hf_greedy, splits, start_mesh, stepped_logits
from tests.test_exactness import prompt

pytestmark = pytest.mark.compile

MODELS = ("llama", "windowed-mistral", "qwen2")
LAYERS = 3
"""The compiled graph unrolls every layer of a stage, and inductor's time grows with it: three layers hold what
eight would (each layer's own pool slice and weights, a stage of one layer and one of two)."""


@pytest.fixture(scope="module")
def compile_models(tmp_path_factory):
    """Tiny models of LAYERS layers, Mistral's with a 16-position sliding window (the prompts below run past it)."""
    root = tmp_path_factory.mktemp("compile-models")
    return {"llama": make_tiny_model(root / "llama", "llama", layers=LAYERS, seed=7),
            "windowed-mistral": make_tiny_model(root / "mistral", "mistral", layers=LAYERS, sliding_window=16, seed=7),
            "qwen2": make_tiny_model(root / "qwen2", "qwen2", layers=LAYERS, seed=7)}


ATTENTIONS = [*((family, "kernel", False) for family in MODELS), ("windowed-mistral", "written-out", False),
              ("qwen2", "kernel", True), ("windowed-mistral", "written-out", True)]


@pytest.mark.parametrize(("family", "attention", "packed"), ATTENTIONS,
                         ids=[f"{f}-{a}{'-packed' if p else ''}" for f, a, p in ATTENTIONS])
def test_batched_decode_passes_compiled_match_transformers(compile_models, family, attention, packed):
    """The whole model in one compiled stage, in process: sessions of 1-17 positions in 4-position blocks, decoded
    together in passes of 1 to 4 of them (the batcher's decode passes), each crossing many block boundaries.
    Every step's logits within 1e-4 of transformers' forward pass, greedy tokens the same, and no graph compiled
    after the warm-up as the batch size and the key length vary. Attention in the graph is the paged attention
    kernel (a stage on the CPU), or written out for inductor (a stage without the kernel); the Linears torch's, or
    packed (stagemesh::packed_linear, opaque in the graph as the attention kernel is; qwen2's q/k/v have biases)."""
    path = compile_models[family]
    model = load_stage(path, 0, None)
    if packed:
        if packed_weights.available(model) is not None:
            pytest.skip(f"no packed weights here: {packed_weights.available(model)}")
        packed_weights.pack(model)
    if attention == "kernel":
        paged_attention.attach(model)
        if model.decode_attention is None:
            pytest.skip("the paged attention kernel could not be built here (tests/test_paged_attention.py says why)")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    # Slots not yet written hold whatever the memory held, NaN included (the pool is torch.empty; recycled
    # memory in a long-lived process is not zero): the masked keys of a session's last block must not matter.
    pool.k[:, pool.block_size:] = float("nan")
    pool.v[:, pool.block_size:] = float("nan")
    compile_stage(model)
    warm_up_decode(model, pool)
    assert is_compiled(model)
    warmed = compiled_graphs(model)
    assert 1 <= warmed <= 2  # B = 1 and B >= 2
    seqs = [prompt(n, seed=60 + n) for n in (1, 5, 9, 17)]
    # passes of sizes 1-4, sessions in any order: each one compiled pass
    batches = [[0, 1, 2, 3][: (4, 1, 3, 2)[k % 4]] if k % 5 else [3, 1] for k in range(14)]
    caches = decode_passes_match_transformers(model, hf, pool, seqs, batches)
    assert max(c.length for c in caches) > 16 + 4  # past the window, over many blocks
    assert is_compiled(model) and compiled_graphs(model) == warmed  # no recompilation


@pytest.mark.parametrize("family", MODELS)
async def test_compiled_split_is_exact(compile_models, family):
    """A 2-stage split served over gRPC with --compile: the router's greedy tokens equal transformers'
    generate(), each step's logits within 1e-4 of its forward pass, and no stage compiles again after its
    warm-up."""
    path = compile_models[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mesh = await start_mesh(path, [splits(1, 2)], stage_options={"compile": True})
    try:
        assert all(is_compiled(s.model) for s in mesh.all_stages())  # compiled, not fallen back to eager
        packed = [any(isinstance(m, packed_weights.PackedLinear) for m in s.model.modules()) for s in mesh.all_stages()]
        assert all(packed) or not cpu_kernels.load()  # the default, where the kernels build
        warmed = [compiled_graphs(s.model) for s in mesh.all_stages()]
        ids = prompt(20, seed=31)
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=24)))
        assert got == hf_greedy(hf, ids, 24)
        tokens, logits = await stepped_logits([s.address for s in mesh.stages[0]], ids, 6, "compile-test")
        with torch.inference_mode():
            ref = hf(torch.tensor([ids + tokens])).logits[0]
        for k, row in enumerate(logits):
            torch.testing.assert_close(row, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)
        assert [compiled_graphs(s.model) for s in mesh.all_stages()] == warmed
    finally:
        await mesh.stop()


def test_compile_is_refused_with_quantize(tiny_model):
    with pytest.raises(ValueError, match="--compile.*--quantize"):
        StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, quantize="int8", compile=True)


async def test_a_failed_compilation_serves_eager(tiny_models, hf_models, monkeypatch, caplog):
    """No working C++ compiler for inductor (and no cached graph to fall back on): the warm-up's compilation
    fails, the stage logs it once and serves the same tokens eagerly."""
    real_warm_up = server_module.warm_up

    def warm_up_without_a_compiler(*args):  # inductor's config is per thread: set it on the compute thread
        with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
            return real_warm_up(*args)

    monkeypatch.setattr(server_module, "warm_up", warm_up_without_a_compiler)
    torch._dynamo.reset()  # no graph compiled by an earlier test may serve here
    caplog.set_level(logging.WARNING, logger="stagemesh.stage")
    mesh = await start_mesh(tiny_models["llama"], [splits(8)], stage_options={"compile": True})
    try:
        assert not is_compiled(mesh.stages[0][0].model)
        failures = [r for r in caplog.records if "compilation failed" in r.getMessage()]
        assert len(failures) == 1 and "serving eager" in failures[0].getMessage()
        ids = prompt(12, seed=5)
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=8)))
        assert got == hf_greedy(hf_models["llama"], ids, 8)
    finally:
        await mesh.stop()
        torch._dynamo.reset()
