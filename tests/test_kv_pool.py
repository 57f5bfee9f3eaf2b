"""The paged KV pool: blocks as sessions grow, admission by look-ahead, preemption of the newest when
the pool runs dry, every block back at the end; batched attention over it exact against transformers."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from stagemesh import tensor_codec
from stagemesh.router.generation import GenerationConfig
from stagemesh.stage_server.config import BatcherConfig
from stagemesh.stage_server.engine import paged_attention, pass_plan
from stagemesh.stage_server.engine.batcher import StepBatcher, StepRequest
from stagemesh.stage_server.engine.kv_pool import KVPool, PoolExhausted, Preempted
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.model import StageModel, StepSlice
from stagemesh.stage_server.engine.pass_plan import MAX_DECODE_GROUPS, MAX_DECODE_PADDING, length_buckets, plan_pass
from stagemesh.stage_server.service.sessions import SessionTable
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import stage_pb2
from tests.conftest import StageSessions, collect, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt
from tests.test_traffic import request

TINY_BLOCK_BYTES = 2 * 8 * 4 * 16 * 32 * 4  # K and V, 8 layers, 4 kv heads, 16 positions, head_dim 32, float32


def kv_gb_for_blocks(blocks: int, layers: int = 8) -> float:
    """--kv-cache-gb for a tiny-model stage of `layers` layers whose pool has `blocks` usable blocks of 16."""
    return (blocks + 1) * TINY_BLOCK_BYTES * layers / 8 / 2**30  # + the null block


def pool(blocks: int, block_size: int = 4, lookahead: int = 1) -> KVPool:
    return KVPool((blocks + 1) * 2 * 2 * 2 * block_size * 8 * 4, 2, 2, 8, torch.float32, "cpu", block_size, lookahead)


def test_blocks_follow_the_session_and_all_come_back():
    p = pool(6)
    a = p.allocate(100)  # an upper bound: nothing is taken at open
    assert (a.blocks, p.blocks_used) == ([], 0)
    p.grow(a, 1)
    p.grow(a, 4)
    assert len(a.blocks) == 1  # positions 0..3: one block of 4
    p.grow(a, 5)  # position 4 crosses into a second block
    assert len(a.blocks) == 2 and p.slots(a, 3, 5) == [a.blocks[0] * 4 + 3, a.blocks[1] * 4]
    p.release(a)
    assert p.blocks_used == 0 and not a.blocks


def test_admission_counts_what_a_session_holds_plus_its_look_ahead():
    p = pool(5, lookahead=2)
    a = p.allocate(1000)
    p.grow(a, 8)  # holds 2, reserves 4
    p.allocate(4)  # reserves 1 (its max_length needs no more)
    with pytest.raises(PoolExhausted, match="--kv-cache-gb"):
        p.allocate(1)
    assert p.blocks_used == 2


def test_a_dry_pool_preempts_the_newest_session():
    p = pool(4)
    old, mid, new = p.allocate(64), p.allocate(64), p.allocate(64)
    p.grow(old, 8)
    p.grow(new, 4)
    p.grow(mid, 4)  # the pool is dry now
    assert p.grow(old, 12) == [new]  # old needs a block: the newest session gives its blocks up
    assert new.preempted and not new.blocks and p.preemptions == 1
    with pytest.raises(Preempted, match="preempted"):
        p.grow(new, 5)  # its next step is refused
    with pytest.raises(Preempted):
        p.grow(mid, 8)  # mid is now the newest holding blocks: asking for more preempts itself
    assert mid.preempted and len(old.blocks) == 3
    for c in (old, mid, new):
        p.release(c)
    assert p.blocks_used == 0


def test_a_session_closed_while_a_pass_reads_it_keeps_its_blocks_till_the_pass_ends():
    p = pool(4)
    a, b = p.allocate(64), p.allocate(64)
    p.grow(a, 8)
    table = list(a.blocks)
    with p.reading([a]):
        p.release(a)  # its stream ended on the event loop, mid-pass
        p.release(b)  # not in the pass: at once
        assert a.blocks == table and p.blocks_used == 2 and not p.grow(p.allocate(64), 8)  # none of a's given out
        with pytest.raises(PoolExhausted, match="closed"):
            p.grow(a, 12)
    assert not a.blocks and p.blocks_used == 2  # the third session's


# --- batched attention over the pool, in process, against transformers -------------------------------


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("windowed") / "mistral", "mistral", layers=4, sliding_window=8,
                           seed=11)


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1]


def _run(model: StageModel, kv: KVPool, parts: list[tuple[object, list[int]]]) -> torch.Tensor:
    """One pass: each (cache, new ids) continues its session. Returns the last logits per part."""
    steps, offset = [], 0
    for cache, ids in parts:
        kv.grow(cache, cache.length + len(ids))
        steps.append(StepSlice(cache, offset, cache.length, len(ids)))
        offset += len(ids)
    return model(torch.tensor([t for _, ids in parts for t in ids]), steps)


@pytest.fixture(scope="module")
def mha_llama(tmp_path_factory):
    """No grouped queries (as many kv heads as heads): the decode path's [kvH, B, 1, D] output is then a
    strided view; a batched decode pass of such a model once failed to flatten it."""
    return make_tiny_model(tmp_path_factory.mktemp("mha") / "llama", "llama", layers=2, heads=8, kv_heads=8, seed=13)


@pytest.mark.parametrize("attention", ["kernel", "gather"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "windowed-mistral", "mha-llama"])
def test_many_sessions_of_different_lengths_in_one_pass_match_transformers(tiny_models, windowed_mistral, mha_llama,
                                                                           family, attention):
    """Prefills of different lengths in one pass, then passes that mix decode steps with a chunked prefill
    over an existing cache, in blocks of 4 positions (every session crosses many block boundaries);
    the blocks of different sessions interleave in the pool. Logits within 1e-4 of transformers, with decode
    steps attended by the paged attention kernel and by SDPA over gathered K/V."""
    path = {"windowed-mistral": windowed_mistral, "mha-llama": mha_llama}.get(family) or tiny_models[family]
    model = load_stage(path, 0, None)
    if attention == "kernel":
        paged_attention.attach(model)
        if model.decode_attention is None:
            pytest.skip("the paged attention kernel could not be built here (tests/test_paged_attention.py says why)")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a = model.args
    kv = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4)
    rng = random.Random(5)
    seqs = [prompt(n, seed=40 + n) for n in (1, 3, 4, 5, 9, 17)]
    caches = [kv.allocate(200) for _ in seqs]
    out = _run(model, kv, list(zip(caches, seqs, strict=True)))
    for i, ids in enumerate(seqs):
        torch.testing.assert_close(out[i], _reference(hf, ids), atol=1e-4, rtol=0)
    late = prompt(23, seed=99)  # joins later, in chunks of 7, beside the others' decode steps
    late_cache, done = kv.allocate(200), 0
    for _ in range(6):
        parts = [(c, [rng.randrange(4, a.vocab_size)]) for c in caches]
        if done < len(late):
            parts.insert(2, (late_cache, late[done : done + 7]))
        out = _run(model, kv, parts)
        for (c, ids), logits in zip(parts, out, strict=True):
            seq = late[: done + len(ids)] if c is late_cache else seqs[caches.index(c)] + ids
            if c is late_cache:
                done += len(ids)
            else:
                seqs[caches.index(c)] = seq
            torch.testing.assert_close(logits, _reference(hf, seq), atol=1e-4, rtol=0)
    assert kv.blocks_used == sum(len(c.blocks) for c in [*caches, late_cache])
    for c in [*caches, late_cache]:
        kv.release(c)
    assert kv.blocks_used == 0


def test_decode_steps_are_attended_in_a_few_groups_of_similar_lengths():
    """Each group gathers keys padded to its own longest session: within 1.25x of what it holds, in at most 4
    groups (the last takes the rest), every step in exactly one group."""
    steps = [StepSlice(None, i, start, 1) for i, start in enumerate([700, 20, 690, 300, 15, 310, 100, 5, 95, 400])]
    buckets = length_buckets(steps)
    assert sorted(st.offset for b in buckets for st in b) == list(range(len(steps)))
    assert 1 < len(buckets) <= MAX_DECODE_GROUPS
    for b in buckets[:-1]:
        assert len(b) * max(st.start + 1 for st in b) <= MAX_DECODE_PADDING * sum(st.start + 1 for st in b)
    for b in buckets:
        assert [st.offset for st in b] == sorted(st.offset for st in b)  # in the pass's order
    longest = [max(st.start for st in b) for b in buckets]
    assert longest == sorted(longest, reverse=True) and longest[0] == 700
    assert length_buckets(steps, max_groups=1) == [steps]
    assert length_buckets([]) == []


def test_a_pass_of_decode_steps_alone_is_planned_as_any_pass():
    """The paged decode plan (one tensor viewed five ways) holds what the general plan's group and slots do, for
    sessions whose blocks interleave in the pool and whose tables differ in width."""
    kv = pool(40)
    caches = [kv.allocate(64) for _ in range(4)]
    for end in range(1, 23):  # grown in turns: each session's blocks are scattered through the pool
        for c, grow_to in zip(caches, (end, end // 2 + 1, 3, end + 9), strict=True):
            kv.grow(c, grow_to)
    steps = []
    for i, c in enumerate(caches):
        c.length = max(kv.blocks_for(1), len(c.blocks) * kv.block_size - 2)  # a step at a position it holds
        steps.append(StepSlice(c, i, c.length, 1))
    rope = (torch.randn(128, 8), torch.randn(128, 8))
    plan = plan_pass(steps, kv, rope, torch.device("cpu"), lambda *args: None)  # planned with a kernel, never run
    general = pass_plan._group(steps, kv, torch.device("cpu"), True)
    positions = torch.tensor([st.start for st in steps])
    slots = [s for st in steps for s in kv.slots(st.cache, st.start, st.start + 1)]
    (group,) = plan.groups
    assert plan.in_order and plan.slots.tolist() == slots
    assert torch.equal(plan.cos, rope[0][positions, None]) and torch.equal(plan.sin, rope[1][positions, None])
    for name in ("size", "q_len", "k_len"):
        assert getattr(group, name) == getattr(general, name)
    for name in ("rows", "table", "q_pos", "ends"):
        assert torch.equal(getattr(group, name), getattr(general, name)), name
    assert group.valid is None and group.gather is None


# --- every exit path gives the blocks back ------------------------------------------------------------


async def test_blocks_come_back_after_close_expiry_preemption_and_a_failed_step(tiny_models, monkeypatch):
    model = load_stage(tiny_models["llama"], 0, None)
    a = model.args
    kv = KVPool(6 * 2 * 8 * 4 * 4 * 32 * 4, 8, a.num_kv_heads, a.head_dim, model.dtype, "cpu", block_size=4,
                lookahead_blocks=0)  # 5 usable blocks of 4
    sessions = SessionTable(kv, a.max_position)
    batcher = StepBatcher(model, BatcherConfig(), ThreadPoolExecutor(1))
    batcher.start()
    try:
        closed, expired, old, new = (sessions.open(n, 64) for n in ("closed", "expired", "old", "new"))
        for s in (closed, expired):
            await batcher.submit(StepRequest(s, 0, torch.tensor([5, 6, 7, 8, 9])))  # 2 blocks each
        assert kv.blocks_used == 4
        sessions.close("closed")
        sessions.sessions["expired"].last_used -= 1000
        assert sessions.expire_idle(10) == ["expired"]
        assert kv.blocks_used == 0
        await batcher.submit(StepRequest(old, 0, torch.tensor([5, 6, 7, 8])))

        def broken(*_args):
            raise RuntimeError("a broken pass")

        with monkeypatch.context() as patch:
            patch.setattr(model, "forward", broken)
            with pytest.raises(Exception, match="broken pass"):
                await batcher.submit(StepRequest(old, 4, torch.tensor([5, 6, 7, 8, 9])))
        assert len(old.cache.blocks) == 1 and old.cache.length == 4  # the blocks the failed step took went back
        await batcher.submit(StepRequest(new, 0, torch.tensor([5, 6, 7, 8])))
        await batcher.submit(StepRequest(old, 4, torch.tensor(list(range(5, 21)))))  # 5 blocks: takes new's
        with pytest.raises(Preempted, match="preempted to make room"):
            await batcher.submit(StepRequest(new, 4, torch.tensor([9])))
        assert kv.preemptions == 1 and not new.cache.blocks
        sessions.close("new")
        sessions.close("old")
        assert kv.blocks_used == 0 and len(sessions) == 0
    finally:
        await batcher.stop()


# --- a pool that runs dry mid-stream, end to end ------------------------------------------------------


async def test_streams_preempted_mid_stream_finish_exactly_and_free_every_block(tiny_model, hf_models):
    """A 2-stage chain whose pools hold 12 blocks of 16 positions: 6 streams of ~20 + 40 tokens admitted
    at once outgrow it, the newest are preempted mid-stream (RESOURCE_EXHAUSTED, 'preempted'), and the
    router replays them (prompt + tokens so far) when room comes back. Every stream finishes exact,
    and both stages hold 0 blocks at the end."""
    mesh = await start_mesh(
        tiny_model, [splits(4, 4)],
        stage_options={"kv_cache_gb": kv_gb_for_blocks(12, layers=4), "kv_lookahead_blocks": 1,
                       "batcher": BatcherConfig(batch_window_ms=2)},
        router_options={"generation": GenerationConfig(max_full_wait_s=60)})
    try:
        prompts = [prompt(18 + i, seed=300 + i) for i in range(6)]
        results = await asyncio.gather(*[collect(mesh.router_stub.Generate(request(p, 40), timeout=120))
                                         for p in prompts])
        for p, (ids, _, _) in zip(prompts, results, strict=True):
            assert ids == hf_greedy(hf_models["llama"], p, 40)
        stages = mesh.all_stages()
        assert sum(s.pool.preemptions for s in stages) >= 1  # the pool did run dry mid-stream
        for info in await mesh.settled_infos():
            assert (info.kv_blocks_used, info.open_sessions, info.kv_block_size) == (0, 0, 16)
            assert info.kv_blocks_total == 12
    finally:
        await mesh.stop()


async def test_a_preempted_step_says_so(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)], router=False,
                            stage_options={"kv_cache_gb": kv_gb_for_blocks(2), "kv_lookahead_blocks": 0})
    stub = mesh.stage_stub(0, 0)
    try:
        for sid in ("old", "new"):
            await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id=sid, max_length=64))
        call = StageSessions(stub)
        for sid in ("old", "new"):
            await call.send(steps=[request_step(sid, list(range(5, 15)), 0)])  # one block each
            await call.read()
        await call.send(steps=[request_step("old", list(range(5, 15)), 10)])  # a second block: the pool is dry
        await call.read()
        await call.send(steps=[request_step("new", [7], 10)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        call.cancel()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "preempted to make room" in err.value.details()
    finally:
        await mesh.stop()


def request_step(session_id: str, ids: list[int], start: int) -> stage_pb2.ForwardRequest:
    return stage_pb2.ForwardRequest(session_id=session_id, start=start,
                                    token_ids=tensor_codec.encode(torch.tensor(ids)))
