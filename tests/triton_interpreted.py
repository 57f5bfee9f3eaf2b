"""The GPU's Triton kernels (stage_server/gpu/) on CPU tensors, through Triton's interpreter.

Not collected by the suite on its own (its name is not test_*.py): tests/test_triton_attention.py runs it in a
process whose environment has TRITON_INTERPRET=1 before triton is imported, which the interpreter needs.
Checked here: the attention kernel against attention computed in float64 from the pool, for decode steps, prefill chunks
and passes mixing them, sessions of very different lengths, block boundaries, sliding windows, GQA, key splits,
a head size that is not a power of two, float32 and float16 (the interpreter cannot compute in bfloat16: the
GPU check does); a stage's model attending through it against transformers within 1e-4 in float32, every pass
through CUDA graphs' padded buffers likewise; a layer's fused small ops (triton_fused.py) against the ops they
replace, and in those stages; and the int8 weight-only matrix product (triton_int8.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from stagemesh import metrics
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.model import FusedOps, RMSNorm, StepSlice, apply_rope, rope_tables
from stagemesh.stage_server.engine.pass_plan import paged_batch
from stagemesh.stage_server.engine.quantize import int8_rows
from stagemesh.stage_server.gpu import triton_check, triton_fused
from stagemesh.stage_server.gpu.cuda_graphs import GraphedPasses
from stagemesh.stage_server.gpu.triton_attention import decode_attention, paged_attention
from stagemesh.stage_server.gpu.triton_int8 import int8_weight_matmul
from tests.conftest import decode_passes_match_transformers
from tests.test_exactness import prompt

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_attention.py"


def reference(q, k_pool, v_pool, tables, q_lens, starts, page, window, scale) -> torch.Tensor:
    """Each query row over its session's keys, gathered from the pool and computed in float64."""
    T, H, D = q.shape
    group = H // k_pool.shape[1]
    out, row = torch.zeros(T, H, D, dtype=torch.float64), 0
    for b, (n, start) in enumerate(zip(q_lens, starts, strict=True)):
        for i in range(n):
            p = start + i
            keys = torch.arange(max(0, p + 1 - window) if window else 0, p + 1)
            slots = tables[b][keys // page].long() * page + keys % page
            k, v = k_pool[slots].double(), v_pool[slots].double()  # [L, kvH, D]
            for h in range(H):
                scores = k[:, h // group] @ q[row + i, h].double() * scale
                out[row + i, h] = torch.softmax(scores, 0) @ v[:, h // group]
        row += n
    return out


def random_pass(q_lens, starts, *, heads=8, kv_heads=4, head_dim=32, page=16, blocks=64, dtype=torch.float32,
                seed=0):
    """A pool of random K/V, each session's blocks scattered over it, and the pass's queries."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(blocks * page, kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(blocks * page, kv_heads, head_dim, generator=g).to(dtype)
    ends = [s + n for s, n in zip(starts, q_lens, strict=True)]
    width = max(-(-e // page) for e in ends)
    free = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    for b, end in enumerate(ends):
        for j in range(-(-end // page)):
            tables[b, j] = free.pop()
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    return q, k_pool, v_pool, tables


class Steps:
    """StepSlices over a real pool for q_lens/starts (so pass_plan.paged_batch builds the batch)."""

    def __init__(self, q_lens, starts, page=16):
        self.pool = KVPool(1 << 22, 1, 1, 16, torch.float32, block_size=page, huge=False)
        self.steps, offset = [], 0
        for n, start in zip(q_lens, starts, strict=True):
            cache = self.pool.allocate(4096)
            self.pool.grow(cache, start + n)
            cache.length = start
            self.steps.append(StepSlice(cache, offset, start, n))
            offset += n


CASES = {
    "decode steps of different lengths": ([1, 1, 1, 1], [5, 40, 17, 130]),
    "one prefill chunk from position 0": ([37], [0]),
    "a chunk after cached positions": ([20], [33]),
    "mixed: chunks and decode steps": ([7, 1, 20, 1], [0, 33, 16, 95]),
    "on block boundaries": ([16, 1, 1], [16, 15, 31]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_kernel_equals_attention_over_the_gathered_keys(case, window, splits):
    q_lens, starts = CASES[case]
    steps = Steps(q_lens, starts)
    batch = paged_batch(steps.steps, steps.pool, torch.device("cpu"))
    q, k_pool, v_pool, _ = random_pass(q_lens, starts)
    # The pool's own block tables, with random K/V in place of the tiny pool's.
    k_pool = torch.randn(steps.pool.num_blocks * 16, 4, 32)
    v_pool = torch.randn_like(k_pool)
    out = paged_attention(q, k_pool, v_pool, batch, 16, window, 32**-0.5, splits=splits)
    want = reference(q, k_pool, v_pool, batch.tables, q_lens, starts, 16, window, 32**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 24), (8, 8, 64), (6, 2, 48)])
def test_head_shapes_the_tiny_model_does_not_have(heads, kv_heads, head_dim):
    q_lens, starts = [1, 9, 1], [70, 3, 0]
    steps = Steps(q_lens, starts)
    batch = paged_batch(steps.steps, steps.pool, torch.device("cpu"))
    q, _, _, _ = random_pass(q_lens, starts, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    k_pool = torch.randn(steps.pool.num_blocks * 16, kv_heads, head_dim)
    v_pool = torch.randn_like(k_pool)
    out = paged_attention(q, k_pool, v_pool, batch, 16, 0, head_dim**-0.5, splits=2)
    want = reference(q, k_pool, v_pool, batch.tables, q_lens, starts, 16, 0, head_dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_float16_within_its_precision():
    q_lens, starts = [3, 1], [30, 70]
    q, k_pool, v_pool, tables = random_pass(q_lens, starts, dtype=torch.float16)
    steps = Steps(q_lens, starts)
    batch = paged_batch(steps.steps, steps.pool, torch.device("cpu"))
    batch.tables = tables
    out = paged_attention(q, k_pool, v_pool, batch, 16, 0, 32**-0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), reference(q, k_pool, v_pool, tables, q_lens, starts, 16, 0, 32**-0.5),
                               atol=2e-3, rtol=0)


def test_the_decode_signature_made_on_the_device_equals_the_ragged_batch():
    """decode_attention (what a CUDA graph captures) builds its batch from the table and ends alone."""
    starts = [5, 40, 17, 130]
    q, k_pool, v_pool, tables = random_pass([1] * 4, starts)
    out = decode_attention(q, k_pool, v_pool, tables.long(), torch.tensor(starts) + 1, 16, 0, 32**-0.5)
    torch.testing.assert_close(out.double(), reference(q, k_pool, v_pool, tables, [1] * 4, starts, 16, 0, 32**-0.5),
                               atol=1e-5, rtol=0)


FUSED = FusedOps(triton_fused.add_rms_norm, triton_fused.rope_and_write, triton_fused.silu_and_mul)


@pytest.mark.parametrize("layers", [(0, None), (0, 3), (3, None)])
@pytest.mark.parametrize("fused", [False, True])
def test_a_stage_attending_through_the_kernel_equals_transformers(tiny_models, hf_models, layers, fused):
    """Prompts of different lengths prefilled in one pass, then decode passes, across block boundaries: every
    logit within 1e-4 of transformers (a first or middle stage: its hidden states against the model's), with the
    layers' small ops one by one or fused (triton_fused.py)."""
    start, end = layers
    model = load_stage(tiny_models["llama"], start, end, huge=False)
    model.ragged_attention = paged_attention
    model.fused_ops = FUSED if fused else None
    a = model.args
    pool = KVPool(8 << 20, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, block_size=16, huge=False)
    if model.is_last and model.is_first:
        seqs = [prompt(n, seed=60 + n) for n in (3, 17, 40)]
        decode_passes_match_transformers(model, hf_models["llama"], pool, seqs, [[0, 1, 2], [2, 0], [1, 2, 0]])
        return
    ids = [prompt(n, seed=70 + n) for n in (5, 33)]
    caches = [pool.allocate(64) for _ in ids]
    offset, steps = 0, []
    for cache, seq in zip(caches, ids, strict=True):
        pool.grow(cache, len(seq))
        steps.append(StepSlice(cache, offset, 0, len(seq)))
        offset += len(seq)
    with torch.inference_mode():
        runs = [hf_models["llama"](torch.tensor([seq]), output_hidden_states=True) for seq in ids]
        inputs = (torch.tensor([t for seq in ids for t in seq]) if model.is_first
                  else torch.cat([run.hidden_states[start][0] for run in runs]))
        out = model(inputs, steps)
    if model.is_last:  # the logits of each prompt's last position
        torch.testing.assert_close(out, torch.stack([run.logits[0, -1] for run in runs]), atol=1e-4, rtol=0)
    else:
        for run, rows in zip(runs, out.split([len(s) for s in ids]), strict=True):
            torch.testing.assert_close(rows, run.hidden_states[end][0], atol=1e-4, rtol=0)


def eager_passes() -> float:
    return sum(s.value for m in metrics.EAGER_PASSES.collect() for s in m.samples if s.name.endswith("_total"))


def test_passes_through_padded_graph_buckets_equal_transformers(tiny_models, hf_models):
    """Every pass through GraphedPasses' padded buffers (capture=False: the function a graph captures, run on its
    buffers, the layers' small ops fused): prompts of 1-17 tokens prefilled in one mixed pass (3 sessions in a
    bucket of 16 tokens and 16 sessions), decode passes of 1-3 sessions in buckets of 1, 2 and 4, then a chunk
    and decode steps in one mixed pass. Every logit within 1e-4 of transformers and greedy tokens the same, with
    every pool slot no session wrote set to NaN (a padding row that wrote into a session's block, or a key read
    past a session's end, would show); no pass ran eager. A pass past the largest bucket has no graph."""
    model = load_stage(tiny_models["llama"], 0, None, huge=False)
    model.ragged_attention = paged_attention
    model.fused_ops = FUSED  # as a CUDA stage runs (test_a_stage_attending_... checks the layers' own ops too)
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, block_size=4, huge=False)
    pool.k[:, pool.block_size:] = float("nan")
    pool.v[:, pool.block_size:] = float("nan")
    graphed = GraphedPasses(model, pool, max_tokens=32, max_len=64, capture=False, max_sessions=16)
    assert graphed.decode_sizes == [1, 2, 4, 8, 16] and graphed.mixed_sizes == [16, 32]
    model.pass_graphs = graphed
    before = eager_passes()
    seqs = [prompt(n, seed=80 + n) for n in (1, 5, 9)]
    batches = [[[2, 0, 1], [1], [1, 2], [0, 1, 2]][k % 4] for k in range(12)]
    hf = hf_models["llama"]
    caches = decode_passes_match_transformers(model, hf, pool, seqs, batches)
    assert max(c.length for c in caches) > 4 * pool.block_size
    # A mixed pass: a new session's 7-token chunk between two sessions' decode steps.
    new = prompt(7, seed=99)
    cache = pool.allocate(64)
    pool.grow(cache, 7)
    steps = []
    for s in (0, 2):
        pool.grow(caches[s], caches[s].length + 1)
    steps = [StepSlice(caches[0], 0, caches[0].length, 1), StepSlice(cache, 1, 0, 7),
             StepSlice(caches[2], 8, caches[2].length, 1)]
    out = model(torch.tensor([seqs[0][-1], *new, seqs[2][-1]]), steps)
    with torch.inference_mode():
        for row, ids in zip(out, (seqs[0], new, seqs[2]), strict=True):
            torch.testing.assert_close(row, hf(torch.tensor([ids])).logits[0, -1], atol=1e-4, rtol=0)
    assert eager_passes() == before
    too_many = [StepSlice(cache, 0, cache.length, 33)]
    assert graphed(torch.zeros(33, dtype=torch.long), too_many) is None
    assert eager_passes() == before + 1


def test_a_pass_of_padding_alone_runs_in_every_bucket_and_writes_no_sessions_block(tiny_models):
    """What capture_all runs in each bucket before it captures it, and captures: a pass of padding alone. It must
    run (a failure stops every capture, and the stage serves eager) and be inert: only the null block written."""
    model = load_stage(tiny_models["llama"], 0, None, huge=False)
    model.ragged_attention, model.fused_ops = paged_attention, FUSED
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, block_size=4, huge=False)
    pool.k[:, pool.block_size:] = float("nan")
    pool.v[:, pool.block_size:] = float("nan")
    graphed = GraphedPasses(model, pool, max_tokens=16, max_len=64, capture=False, max_sessions=4)
    assert len(graphed.buckets) == 4  # decode passes of 1, 2 and 4 sessions, mixed passes of 16 tokens
    with torch.inference_mode():
        for b in graphed.buckets.values():
            graphed.fill_padding(b)
            assert graphed.run(b).shape == (b.shape.sessions, a.vocab_size)  # the last stage's rows: sessions
    assert pool.k[:, pool.block_size:].isnan().all() and pool.v[:, pool.block_size:].isnan().all()


def test_the_check_that_triton_launches_a_kernel_passes_where_it_does():
    triton_check.launch("cpu")  # through the interpreter here; a stage runs it on its GPU before any kernel


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_weight_kernel_computes_what_int8_weight_linear_computes(rows, dtype, bias):
    """triton_int8.int8_weight_matmul: x @ (q * scale)^T + bias, the weight widened tile by tile, for shapes that
    fill no tile evenly (N 200 of 64-column tiles, K 300 of 128-deep ones)."""
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(300, 200, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 300, generator=g) * 0.05)
    q, scale = int8_rows(linear.weight, torch.float32)
    x = torch.randn(rows, 300, generator=g).to(dtype)
    b = linear.bias.detach().to(dtype) if bias else None
    out = int8_weight_matmul(x, q, scale.to(dtype), b)
    want = x.double() @ (q.double() * scale.double()[:, None]).T + (b.double() if bias else 0)
    assert out.dtype == dtype and out.shape == (rows, 200)
    # float16: the output's own rounding (~1e-3 at these magnitudes)
    torch.testing.assert_close(out.double(), want, atol=1e-4 if dtype == torch.float32 else 2e-3, rtol=0)


def rounding_of(dtype: torch.dtype) -> float:
    """An ulp or two of the dtype at the tests' magnitudes (a few units): float32 sums in another order, float16
    the same ops rounded alike but for that order."""
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("width", [256, 200])
def test_the_fused_add_and_rms_norm_computes_the_add_and_the_layers_norm(dtype, with_residual, width):
    """(RMSNorm(x + residual), x + residual), each rounded as the separate ops round; a width that fills no
    power of two; no residual: the stream is x itself."""
    g = torch.Generator().manual_seed(width)
    x, residual = (torch.randn(5, width, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(width, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=g) + 0.5)
    norm = norm.to(dtype)
    out, stream = triton_fused.add_rms_norm(x, residual if with_residual else None, norm.weight, norm.eps)
    want_stream = x + residual if with_residual else x
    assert stream.dtype == dtype and torch.equal(stream, want_stream)
    with torch.no_grad():
        want = norm(want_stream.float()).to(dtype) if dtype == torch.float32 else norm(want_stream)
    torch.testing.assert_close(out.float(), want.float(), atol=rounding_of(dtype), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [64, 1500])
def test_the_fused_silu_and_mul_computes_silu_of_gate_times_up(dtype, width):
    g = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(3, 2 * width, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up).float(),
                               (torch.nn.functional.silu(gate) * up).float(), atol=rounding_of(dtype), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (6, 2, 48)])
def test_the_fused_rotary_rotates_q_and_k_and_writes_k_and_v_to_their_slots_only(dtype, heads, kv_heads, head_dim):
    """q as apply_rope makes it, k rotated and v as it is in the pool's rows the tokens name, every other row
    untouched (NaN stays NaN); positions and slots in no order, as a mixed pass has them."""
    g = torch.Generator().manual_seed(heads)
    T, H, kvH, D = 7, heads, kv_heads, head_dim
    qkv = torch.randn(T, (H + 2 * kvH) * D, generator=g).to(dtype)
    positions = torch.tensor([3, 0, 41, 42, 7, 100, 5])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = (t[positions, None] for t in rope_tables(inv_freq, 1.0, 128, dtype))
    slots = torch.tensor([9, 2, 30, 31, 17, 50, 4])
    k_pool = torch.full((64, kvH, D), float("nan"), dtype=dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    q = triton_fused.rope_and_write(qkv, cos, sin, slots, k_pool, v_pool, H, kvH)
    qk = apply_rope(qkv[:, : (H + kvH) * D].view(T, H + kvH, D), cos, sin)
    atol = rounding_of(dtype)
    torch.testing.assert_close(q.float(), qk[:, :H].float(), atol=atol, rtol=0)
    torch.testing.assert_close(k_pool[slots].float(), qk[:, H:].float(), atol=atol, rtol=0)
    assert torch.equal(v_pool[slots], qkv[:, (H + kvH) * D :].view(T, kvH, D))
    others = torch.ones(64, dtype=torch.bool)
    others[slots] = False
    assert k_pool[others].isnan().all() and v_pool[others].isnan().all()
