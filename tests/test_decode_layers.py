"""A decode pass's decoder layers in one call (on by default on the CPU in float32: stage_server/cpu/decode_layers.py,
decode_layers.cpp). Exact as before: every decode pass's logits within 1e-4 of transformers and greedy tokens the
same, for every family (qwen2's q/k/v biases, a sliding window), in one stage and split; the layers' output within
float32 rounding of the layers op by op, and the K/V the first writes bit for bit theirs; prefill chunks and mixed
passes stay op by op; a slot outside the pool is refused before anything is written."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from stagemesh.stage_server.cpu import cpu_kernels, decode_layers, packed_weights
from stagemesh.stage_server.engine import paged_attention
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.model import StepSlice
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import router_pb2
from tests.conftest import collect, decode_passes_match_transformers, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt

if not cpu_kernels.load():
    pytest.skip("the CPU kernels could not be built here (tests/test_paged_attention.py says why)",
                allow_module_level=True)

MODELS = ("llama", "windowed-mistral", "qwen2")


@pytest.fixture(scope="module")
def layer_models(tmp_path_factory):
    """Tiny models of 4 layers; Mistral's with an 8-position sliding window (the sessions below run past it)."""
    root = tmp_path_factory.mktemp("layer-models")
    return {"llama": make_tiny_model(root / "llama", "llama", layers=4, seed=7),
            "windowed-mistral": make_tiny_model(root / "mistral", "mistral", layers=4, sliding_window=8, seed=7),
            "qwen2": make_tiny_model(root / "qwen2", "qwen2", layers=4, seed=7)}


def fused_model(path, start=0, end=None):
    """A CPU float32 stage as a stage server makes it: the attention kernel, packed weights, its layers in one call."""
    model = load_stage(path, start, end)
    paged_attention.attach(model)
    packed_weights.pack(model)
    assert decode_layers.attach(model) is None
    return model


def counting(model) -> list[int]:
    """Counts the model's one-call passes from now on: [calls]."""
    calls, run = [0], model.decode_layers

    def counted(inputs, plan):
        calls[0] += 1
        return run(inputs, plan)

    model.decode_layers = counted
    return calls


@pytest.mark.parametrize("family", MODELS)
def test_decode_passes_in_one_call_match_transformers(layer_models, family):
    """The whole model in one stage, in process: four sessions prefilled in one pass (op by op), then decoded in
    passes of 1 to 4 of them, all layers of each pass in one call. Every step's logits within 1e-4 of
    transformers' forward pass and greedy tokens the same, with NaN in every pool slot not yet written."""
    path = layer_models[family]
    model = fused_model(path)
    calls = counting(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    pool.k[:, pool.block_size:] = float("nan")
    pool.v[:, pool.block_size:] = float("nan")
    seqs = [prompt(n, seed=60 + n) for n in (1, 5, 9, 17)]
    batches = [[0, 1, 2, 3][: (4, 1, 3, 2)[k % 4]] if k % 5 else [3, 1] for k in range(14)]
    caches = decode_passes_match_transformers(model, hf, pool, seqs, batches)
    assert max(c.length for c in caches) > 20  # far past the 8-position window, over many blocks
    assert calls[0] == len(batches)  # every decode pass, all its layers in one call; the prefill op by op


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_call_is_the_layers_op_by_op(layer_models, family, where):
    """Two layers of a split as its first stage (token ids in: the embedding inside the call), a middle stage
    (hidden states in and out) and its last (the final norm and LM head inside the call: logits out), the same
    decode pass of 1 to 5 sessions run both ways, each from the same pool contents: outputs within float32
    rounding (1e-5), and the K/V each step wrote in the first layer bit for bit the same (rotary embedding rounds
    as torch's ops do), in the second within that rounding. Each case brings a new pool: the views of the pool
    the call keeps between passes follow it."""
    start = {"first": 0, "middle": 1, "last": 2}[where]
    model = fused_model(layer_models[family], start, start + 2)
    one_call = model.decode_layers
    a = model.args
    torch.manual_seed(5)

    def inputs(n: int) -> torch.Tensor:
        return torch.randint(3, a.vocab_size, (n,)) if model.is_first else torch.randn(n, a.hidden_size)

    for sessions in (1, 2, 5):
        pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
        pool.k.zero_()  # torch.empty's memory may hold NaN, which no two copies of equal
        pool.v.zero_()
        caches = [pool.allocate(64) for _ in range(sessions)]
        for i, cache in enumerate(caches):  # prefilled op by op
            n = 3 + 7 * i
            pool.grow(cache, n)
            model(inputs(n), [StepSlice(cache, 0, 0, n)])
        for cache in caches:
            pool.grow(cache, cache.length + 1)
        x = inputs(sessions)
        starts = [c.length for c in caches]
        before = pool.k.clone(), pool.v.clone()
        outputs, pools = [], []
        for run in (None, one_call):
            model.decode_layers = run
            pool.k.copy_(before[0])  # each run writes its own K/V into the pool as it was
            pool.v.copy_(before[1])
            for cache, start in zip(caches, starts, strict=True):
                cache.length = start
            outputs.append(model(x, [StepSlice(c, i, c.length, 1) for i, c in enumerate(caches)]))
            pools.append((pool.k.clone(), pool.v.clone()))
        assert outputs[1].shape == (sessions, a.vocab_size if where == "last" else a.hidden_size)
        assert not torch.equal(pools[0][0][0], before[0][0]) and not torch.equal(pools[0][0][1], before[0][1])
        torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
        first = [torch.equal(pools[1][kv][0], pools[0][kv][0]) for kv in (0, 1)]  # from the same input
        assert first == [True, True]
        for kv in (0, 1):  # the second layer's input carries the first's rounding
            torch.testing.assert_close(pools[1][kv][1], pools[0][kv][1], atol=1e-5, rtol=1e-5)
    took = one_call._args  # what the call passed: the embedding on the first stage, the head on the last
    assert (took.embed is not None, took.with_head) == (where == "first", where == "last")


def test_a_tied_head_stays_outside_the_call(tmp_path):
    """A model whose LM head is its embedding matrix keeps a plain Linear head (packing leaves it, and its norm,
    alone): the call embeds and runs the layers, the head runs after it, and the logits still match transformers."""
    path = make_tiny_model(tmp_path / "tied", "llama", layers=2, tie_word_embeddings=True, seed=9)
    model = fused_model(path)
    calls = counting(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    seqs = [prompt(n, seed=80 + n) for n in (3, 6)]
    decode_passes_match_transformers(model, hf, pool, seqs, [[0, 1], [1], [0, 1]])
    assert calls[0] == 3
    assert not isinstance(model.lm_head, packed_weights.PackedLinear)


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(layer_models):
    """The op checks where it will write, in every layer, before the first: a step whose slot lies past the
    second layer's pool fails with the reason, and neither layer's pool is written."""
    model = fused_model(layer_models["llama"], 0, 2)
    a = model.args
    pool = KVPool(1 << 20, 2, a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    pool.k.zero_()
    pool.v.zero_()
    cos, sin = model.rope(8, torch.float32)
    weights = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_proj.panels, None, attn.qkv_proj.norm_weight, attn.o_proj.panels, None,
                    mlp.gate_up_proj.panels, None, mlp.gate_up_proj.norm_weight, mlp.down_proj.panels, None]
    slot = pool.k.shape[1] - 1  # the last slot of the first layer's view, and past the end of the second's
    with pytest.raises(RuntimeError, match="is not in the pool"):
        torch.ops.stagemesh.decode_layers(
            torch.randn(1, a.hidden_size), weights, [1e-6] * 4, cos[:1].contiguous(), sin[:1].contiguous(),
            torch.tensor([slot]), [pool.k[0], pool.k[1, :-4]], [pool.v[0], pool.v[1, :-4]], torch.tensor([[1]]),
            torch.tensor([1]), pool.block_size, [0, 0], a.num_heads, 0.1)
    assert not pool.k.any() and not pool.v.any()


def test_a_pool_without_kv_heads_is_refused_not_divided_by(layer_models):
    """The op checks the pool's shape before it divides by its kv heads: a pool view of none fails with the reason
    (an integer division by zero would take the whole process down)."""
    model = fused_model(layer_models["llama"], 0, 1)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    a = model.args
    pool = KVPool(1 << 20, 1, a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    weights = [attn.qkv_proj.panels, None, attn.qkv_proj.norm_weight, attn.o_proj.panels, None,
               mlp.gate_up_proj.panels, None, mlp.gate_up_proj.norm_weight, mlp.down_proj.panels, None]
    cos, sin = model.rope(8, torch.float32)
    none = torch.empty(pool.k.shape[1], 0, a.head_dim)
    with pytest.raises(RuntimeError, match="multiple of the pool's kv heads"):
        torch.ops.stagemesh.decode_layers(
            torch.randn(1, a.hidden_size), weights, [1e-6] * 2, cos[:1].contiguous(), sin[:1].contiguous(),
            torch.tensor([0]), [none], [none], torch.tensor([[1]]), torch.tensor([1]), pool.block_size, [0],
            a.num_heads, 0.1)


def test_what_cannot_run_its_layers_in_one_call_says_why(layer_models):
    """Without the attention kernel, or with torch's Linears, decode passes stay op by op, and attach says why."""
    unpacked = load_stage(layer_models["llama"], 0, None)
    paged_attention.attach(unpacked)
    assert "not packed" in decode_layers.attach(unpacked) and unpacked.decode_layers is None
    no_kernel = load_stage(layer_models["llama"], 0, None)
    packed_weights.pack(no_kernel)
    assert "SDPA" in decode_layers.attach(no_kernel) and no_kernel.decode_layers is None


@pytest.mark.parametrize("fused", [True, False], ids=["one-call", "op-by-op"])
async def test_a_served_split_is_exact_either_way(layer_models, fused):
    """A 2-stage split over gRPC, with the one-call passes (the default) and with --no-fused-layers: 6 concurrent
    streams equal transformers' generate() (qwen2: biases in q/k/v)."""
    path = layer_models["qwen2"]
    mesh = await start_mesh(path, [splits(1, 3)], stage_options={"fused_layers": fused})
    try:
        assert all((s.model.decode_layers is not None) == fused for s in mesh.all_stages())
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = [prompt(5 + 9 * i, seed=500 + i) for i in range(6)]
        expected = [hf_greedy(hf, p, 20) for p in prompts]
        results = await asyncio.gather(*(collect(mesh.router_stub.Generate(
            router_pb2.GenerateRequest(token_ids=p, max_new_tokens=20))) for p in prompts))
        assert [r[0] for r in results] == expected
    finally:
        await mesh.stop()
