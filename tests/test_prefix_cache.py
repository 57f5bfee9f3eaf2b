"""Prefix caching: a session that starts with the tokens of an earlier one attaches the KV blocks those left
(stage_server/engine/kv_pool.py) instead of computing them; exact against transformers, whatever each stage of the
chain had cached, and the cached blocks give way to live sessions when the pool runs dry."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from stagemesh import tensor_codec
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.session_mux import REROUTED
from stagemesh.router.step_values import Sampling
from stagemesh.stage_server.engine.kv_pool import KVPool, PoolExhausted, Preempted
from stagemesh.stage_server.service.callers import prefix_domain
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import stage_pb2
from tests.conftest import FAMILIES, NUM_LAYERS, collect, hf_greedy, splits, start_mesh, until
from tests.test_exactness import prompt
from tests.test_traffic import request

BS = 16  # the stages' default --kv-block-size


def pool(blocks: int, block_size: int = 4, lookahead: int = 1) -> KVPool:
    return KVPool((blocks + 1) * 2 * 2 * 2 * block_size * 8 * 4, 2, 2, 8, torch.float32, "cpu", block_size, lookahead)


def computed(p: KVPool, cache, n: int) -> None:
    """As a pass over positions 0..n-1 leaves the session (the pool itself computes nothing)."""
    p.grow(cache, n)
    cache.length = n


def test_a_session_that_starts_like_an_ended_one_attaches_its_full_blocks():
    p = pool(8)
    first = p.allocate(64, p.prefix_keys(list(range(14)), "salt"))  # 3 full blocks of 4, and 2 tokens over
    computed(p, first, 14)
    p.release(first)
    assert (p.blocks_used, p.cached_blocks) == (0, 3)  # nobody holds them; they stay indexed

    same_start = p.allocate(64, p.prefix_keys([0, 1, 2, 3, 4, 5, 6, 7, 99, 99, 99, 99], "salt"))
    assert (same_start.attached, same_start.length, p.blocks_used) == (8, 8, 2)  # 2 blocks agree
    other_salt = p.allocate(64, p.prefix_keys(list(range(14)), "another upstream"))
    assert other_salt.attached == 0
    again = p.allocate(64, p.prefix_keys(list(range(14)), "salt"))
    assert again.attached == 12 and again.blocks[:2] == same_start.blocks  # shared, held once
    assert p.blocks_used == 3 and p.refs[again.blocks[0]] == 2
    for c in (same_start, other_salt, again):
        p.release(c)
    assert p.blocks_used == 0 and p.cached_blocks == 3


def test_blocks_a_pass_computed_are_found_before_their_session_steps_again_or_closes():
    """A step's answer goes out when its pass ends; a session opened with the same tokens right then (before the
    first one's next step or its close, which come whenever its caller sends them) attaches the blocks that pass
    computed. Before, they were indexed only at the session's next growth or its end: a caller quick enough to
    open the second session first computed them again (a race tests/test_prefix_cache.py lost under load)."""
    p = pool(8)
    first = p.allocate(64, p.prefix_keys(list(range(14)), "salt"))
    with p.reading([first]):
        computed(p, first, 14)  # the pass: 3 full blocks and 2 positions
    follower = p.allocate(64, p.prefix_keys(list(range(14)), "salt"))
    assert follower.attached == 12 and follower.blocks[:3] == first.blocks[:3]
    p.release(first)
    p.release(follower)


def test_an_attached_prefix_leaves_a_position_to_compute():
    p = pool(8)
    first = p.allocate(64, p.prefix_keys(list(range(8)), ""))
    computed(p, first, 8)
    p.release(first)
    assert p.allocate(8, p.prefix_keys(list(range(8)), "")).attached == 4  # max_length 8: position 7 is computed


def test_cached_blocks_give_way_before_any_session_is_preempted():
    p = pool(6)
    for seed in range(3):  # 3 ended sessions leave 6 cached blocks: the whole pool
        c = p.allocate(64, p.prefix_keys([seed] * 8, ""))
        computed(p, c, 8)
        p.release(c)
    assert (p.cached_blocks, p.blocks_used, len(p.free)) == (6, 0, 0)
    kept = p.allocate(64, p.prefix_keys([2] * 8, ""))  # holds the newest 2
    live = p.allocate(64)
    assert p.grow(live, 16) == []  # 4 blocks: taken from the least recently used cached ones, nobody preempted
    assert p.preemptions == 0 and p.cached_blocks == 2 and kept.attached == 8
    p.release(live)
    assert p.allocate(64, p.prefix_keys([0] * 8, "")).attached == 0  # evicted


def test_admission_counts_a_shared_block_once():
    p = pool(6, lookahead=1)
    first = p.allocate(64, p.prefix_keys(list(range(16)), ""))
    computed(p, first, 16)
    p.release(first)
    # 4 blocks each and 1 ahead: 10 of the pool's 6, were the 4 counted twice.
    sharing = [p.allocate(20, p.prefix_keys(list(range(16)), "")) for _ in range(2)]
    assert [c.attached for c in sharing] == [16, 16] and p.blocks_used == 4
    with pytest.raises(PoolExhausted):  # 4 held + 2 look-ahead: the pool is spoken for
        p.allocate(20)


def test_a_first_step_before_the_attached_positions_lets_the_rest_go():
    p = pool(8)
    p.k.normal_()  # as if computed (empty memory may hold NaN, which equals nothing)
    first = p.allocate(64, p.prefix_keys(list(range(12)), ""))
    computed(p, first, 12)
    p.release(first)
    c, d = (p.allocate(64, p.prefix_keys(list(range(13)), "")) for _ in range(2))
    assert c.attached == d.attached == 12
    p.rewind(c, 4)
    assert (c.length, len(c.blocks), p.blocks_used) == (4, 1, 3)
    shared = c.blocks[0]
    p.rewind(c, 2)  # inside a block d holds too: c gets its own copy to write into
    assert c.blocks[0] != shared and torch.equal(p.k[:, c.blocks[0] * 4: c.blocks[0] * 4 + 2],
                                                 p.k[:, shared * 4: shared * 4 + 2])
    p.rewind(d, 2)  # d alone holds it now: it keeps the block, which leaves the index (d writes into it)
    assert d.blocks == [shared] and shared not in p.key_of and p.cached_blocks == 2
    p.release(c)
    p.release(d)
    assert p.blocks_used == 0


def test_a_rewind_into_a_shared_block_with_no_room_to_copy_it_preempts_the_session():
    p = pool(2, lookahead=0)
    first = p.allocate(64, p.prefix_keys(list(range(8)), ""))
    computed(p, first, 8)
    p.release(first)
    a, b = (p.allocate(16, p.prefix_keys(list(range(9)), "")) for _ in range(2))
    assert a.attached == b.attached == 8 and not p.free and not p.evictable
    with pytest.raises(Preempted):
        p.rewind(a, 6)  # it would write positions 6 and 7 of a block b reads
    assert a.preempted and not a.blocks and b.blocks == [1, 2] and p.refs[1:] == [1, 1]


def test_a_dry_pool_preempts_a_session_that_frees_a_block_not_one_that_only_shares():
    p = pool(4, lookahead=0)
    first = p.allocate(16, p.prefix_keys(list(range(8)), ""))
    computed(p, first, 8)
    p.release(first)
    a = p.allocate(64)
    computed(p, a, 8)  # 2 blocks of its own: the pool is dry after b and c
    b = p.allocate(16, p.prefix_keys(list(range(9)), ""))
    c = p.allocate(16, p.prefix_keys(list(range(9)), ""))  # the newest, but every block it holds is b's too
    assert (b.attached, c.attached, len(p.free), len(p.evictable)) == (8, 8, 0, 0)
    assert p.grow(b, 9) == [a]  # c would free nothing
    assert not c.preempted and p.preemptions == 1


def test_a_rewound_prefix_is_evicted_tail_first():
    p = pool(6, lookahead=0)
    first = p.allocate(16, p.prefix_keys(list(range(12)), ""))
    computed(p, first, 12)
    head, middle, tail = first.blocks
    p.rewind(first, 0)
    assert list(p.evictable) == [tail, middle, head]  # the least useful first: a prefix's tail alone matches nothing


def test_the_prefix_cache_is_shared_by_one_host_or_the_mesh_not_by_anyone():
    class Context:
        def __init__(self, peer: str, cert: bool = False):
            self._peer, self._cert = peer, cert

        def peer(self) -> str:
            return self._peer

        def auth_context(self) -> dict:
            return {"x509_pem_cert": [b"..."]} if self._cert else {}

    assert prefix_domain(Context("ipv4:10.0.0.5:40001")) == prefix_domain(Context("ipv4:10.0.0.5:40002"))
    assert prefix_domain(Context("ipv4:10.0.0.5:40001")) != prefix_domain(Context("ipv4:10.0.0.6:40001"))
    assert prefix_domain(Context("ipv6:[::1]:5000")) == "ipv6:[::1]"
    assert prefix_domain(Context("ipv4:10.0.0.5:1", cert=True)) == prefix_domain(Context("ipv4:10.0.0.6:1", cert=True))


async def _logits_after(addresses: list[str], ids: list[int], prefix: list[int],
                        answers: bool = True) -> tuple[int | None, torch.Tensor | None, int]:
    """One session on these stages, opened with prefix as its prefix_ids and fed ids past what every stage
    attached: (its next token, that token's logits, positions attached). A first stage alone (answers False)
    answers nothing: its step is known done when a Reroute sent after it, to where it ends, is answered."""
    chain = Chain([StageEndpoint(a) for a in addresses])
    try:
        async with ChainSession(chain, max_length=len(ids) + 8, request_id="prefix", prefix_ids=prefix) as session:
            attached = session.position
            if not answers:
                session.send(ids[attached:], Sampling(), 0, False)
                session.muxes[0].reroute(session.session_id, len(ids))
                await session.wait_for(0, REROUTED, len(ids) - attached, "to a reroute after the step")
                return None, None, attached
            result = await session.step(ids[attached:], sampling=Sampling(), return_logits=True)
            logits = tensor_codec.decode(result.logits) if result.logits is not None else None  # a last stage's
            return result.token_id, logits, attached
    finally:
        for stage in chain.stages:
            await stage.close()


async def info(mesh, index: int) -> stage_pb2.StageInfo:
    return await mesh.stage_stub(0, index).Info(stage_pb2.InfoRequest(), timeout=10)


async def test_stages_that_cached_different_lengths_start_together_and_stay_exact(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(3, 5)], router=False)
    try:
        addresses = [s.address for s in mesh.stages[0]]
        ids = prompt(75, seed=41)
        await _logits_after(addresses, ids[:33], ids[:32])  # both stages: 2 blocks of 16
        await _logits_after(addresses[:1], ids[:70], ids[:69], answers=False)  # the first stage alone: 4 blocks
        assert [(await info(mesh, i)).kv_prefix_blocks for i in range(2)] == [4, 2]

        token, logits, attached = await _logits_after(addresses, ids, ids[:-1])
        assert attached == 2 * BS  # the first stage had 4 blocks, the second 2: both start at 32
        with torch.inference_mode():
            ref = hf_models["llama"](torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
        assert token == int(ref.argmax())
        # Used, not computed: the first stage 2 blocks for its lone session and 2 for this one (of the 4 it
        # attached), the second stage 2.
        assert [(await info(mesh, i)).kv_prefix_hit_positions for i in range(2)] == [4 * BS, 2 * BS]
        infos = await mesh.settled_infos()
        assert [(i.open_sessions, i.kv_blocks_used) for i in infos] == [(0, 0), (0, 0)]
    finally:
        await mesh.stop()


@pytest.fixture(scope="module")
def models(tiny_models, hf_models, tmp_path_factory):
    """The tiny models and transformers' of each, Mistral's with a 16-position sliding window (the prompts run past
    it): family -> (checkpoint, transformers model)."""
    windowed = make_tiny_model(tmp_path_factory.mktemp("windowed") / "mistral", "mistral", layers=NUM_LAYERS,
                               sliding_window=16, seed=7)
    hf_windowed = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32).eval()
    return {**{f: (tiny_models[f], hf_models[f]) for f in FAMILIES}, "windowed-mistral": (windowed, hf_windowed)}


@pytest.mark.parametrize("family", [*FAMILIES, "windowed-mistral"])
async def test_decoding_over_attached_blocks_is_exact_for_every_family(family, models):
    path, hf = models[family]
    mesh = await start_mesh(path, [splits(3, 5)], router=False)
    chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
    try:
        ids = prompt(70, seed=50)
        await _logits_after([s.address for s in chain.stages], ids[:40], ids[:39])  # leaves 2 blocks on both
        tokens, logits = [], []
        async with ChainSession(chain, max_length=80, request_id="hit", prefix_ids=ids[:-1]) as session:
            assert session.position == 2 * BS
            feed = ids[session.position:]
            for _ in range(5):  # the prompt's rest, then 4 decode steps over the shared blocks
                result = await session.step(feed, sampling=Sampling(), return_logits=True)
                tokens.append(result.token_id)
                logits.append(tensor_codec.decode(result.logits))
                feed = [result.token_id]
        with torch.inference_mode():
            ref = hf(torch.tensor([ids + tokens])).logits[0]
        for k, got in enumerate(logits):
            torch.testing.assert_close(got, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)
        assert tokens == hf_greedy(hf, ids, 5)
    finally:
        for stage in chain.stages:
            await stage.close()
        await mesh.stop()


async def test_prompts_that_share_a_start_reuse_it_and_stream_what_transformers_does(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        system = prompt(50, seed=42)  # 3 full blocks
        prompts = [system + prompt(9, seed=43), system + prompt(20, seed=44), system[:40], system + prompt(9, seed=43)]
        cached = []
        for ids in prompts:
            got, _, responses = await collect(mesh.router_stub.Generate(request(ids, 12)))
            assert got == hf_greedy(hf_models["llama"], ids, 12)
            cached.append(responses[-1].cached_tokens)
        # Each stage attached the system prompt's 3 full blocks for the 2nd and the 4th (the 4th repeats the 1st,
        # whose 59 tokens fill 3), and 2 for the 3rd (its 39 tokens before the last fill 2).
        assert cached == [0, 3 * BS, 2 * BS, 3 * BS]
        hits = [(await info(mesh, i)).kv_prefix_hit_positions for i in range(2)]
        assert hits == [(3 + 2 + 3) * BS] * 2
        infos = await mesh.settled_infos()
        assert [(i.open_sessions, i.kv_blocks_used) for i in infos] == [(0, 0), (0, 0)]
    finally:
        await mesh.stop()


async def test_a_stage_without_prefix_caching_attaches_nothing(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(8)], stage_options={"prefix_cache": False})
    try:
        ids = prompt(40, seed=45)
        for _ in range(2):
            got, _, _ = await collect(mesh.router_stub.Generate(request(ids, 4)))
            assert got == hf_greedy(hf_models["llama"], ids, 4)
        i = await info(mesh, 0)
        assert (i.kv_prefix_blocks, i.kv_prefix_hit_positions) == (0, 0)
    finally:
        await mesh.stop()


async def test_a_first_step_past_the_attached_positions_is_refused(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(8)], router=False)
    try:
        address = mesh.stages[0][0].address
        ids = prompt(60, seed=46)
        await _logits_after([address], ids[:40], ids[:39])  # 2 blocks cached
        chain = Chain([StageEndpoint(address)])
        try:
            async with ChainSession(chain, max_length=64, request_id="skip", prefix_ids=ids[:-1]) as session:
                assert session.position == 2 * BS
                session.position = 3 * BS  # positions it does not hold
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await session.step(ids[3 * BS:], sampling=Sampling())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "must start at 32" in err.value.details()
        finally:
            await chain.stages[0].close()
    finally:
        await mesh.stop()


async def test_a_block_stepped_with_other_tokens_than_it_claims_is_never_attached(tiny_model, hf_models):
    """A session opened claiming prompt A but stepped with B (a planted block) leaves nothing under A's keys: the
    first stage registers a block only when the tokens it computed are the ones its key stands for."""
    mesh = await start_mesh(tiny_model, [splits(8)], router=False)
    try:
        address = mesh.stages[0][0].address
        a, b = prompt(40, seed=47), prompt(40, seed=48)
        await _logits_after([address], b[:20] + a[20:], a[:-1])  # the first block planted, the second computed
        token, logits, attached = await _logits_after([address], a, a[:-1])
        assert attached == 0  # the second block's key chains through the first: neither is attached
        with torch.inference_mode():
            ref = hf_models["llama"](torch.tensor([a])).logits[0, -1]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
        assert token == int(ref.argmax())
        assert (await _logits_after([address], a, a[:-1]))[2] == 2 * BS  # the true blocks are found
    finally:
        await mesh.stop()


def _value(tokens: list[int], position: int) -> float:
    """What a pass would leave at position: a function of the tokens up to it (exact in float32)."""
    return float(hash(tuple(tokens[: position + 1])) % (1 << 20))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["open", "step", "rewind", "close"]), st.integers(0, 5),
                              st.integers(0, 40)), max_size=40))
def test_sessions_that_share_blocks_never_see_each_others_writes(ops):
    """Random opens (prompts that agree on a random start), steps, rewinds and closes on a small pool: every
    position a session holds keeps the value its own tokens gave it, and every block is free, cached or held,
    by exactly the sessions that hold it."""
    p = pool(10, lookahead=0)
    base = list(range(100, 140))
    live: list[tuple[object, list[int]]] = []
    for kind, who, arg in ops:
        if kind == "open":
            tokens = base[:arg] + [200 + who] * (40 - arg)  # agrees with the others on its first `arg` tokens
            try:
                cache = p.allocate(40, p.prefix_keys(tokens[: min(39, arg + who)], ""))
            except PoolExhausted:
                continue
            live.append((cache, tokens))
        elif live:
            cache, tokens = live[who % len(live)]
            if kind == "close":
                p.release(cache)
                live.remove((cache, tokens))
            elif cache.preempted:
                continue
            elif kind == "rewind":
                try:
                    p.rewind(cache, min(arg, cache.length))
                except Preempted:
                    pass
            else:
                end = min(40, cache.length + 1 + arg % 8)
                try:
                    p.grow(cache, end)
                except PoolExhausted:
                    continue
                for pos in range(cache.length, end):  # the pass writes its new positions
                    p.k[0, p.slots(cache, pos, pos + 1)[0], 0, 0] = _value(tokens, pos)
                cache.length = end
        holders = [c for c, _ in live if not c.preempted]
        for block in range(1, p.num_blocks):
            assert p.refs[block] == sum(c.blocks.count(block) for c in holders)
            assert (block in p.free) + (block in p.evictable) + (p.refs[block] > 0) == 1
        assert set(p.evictable) <= set(p.key_of) and {p.cached[k] for k in p.key_of.values()} == set(p.key_of)
        for c, tokens in live:
            if not c.preempted:
                assert len(c.blocks) >= p.blocks_for(c.length)
                for pos in range(c.length):
                    assert float(p.k[0, p.slots(c, pos, pos + 1)[0], 0, 0]) == _value(tokens, pos), (pos, c)


@pytest.mark.parametrize("dead", [1, 2])
@pytest.mark.parametrize("replacement", ["holds the prefix", "cold"])
async def test_a_stream_that_started_from_the_cache_is_repaired_when_a_later_stage_stops(tiny_model, hf_models,
                                                                                        caplog, dead, replacement):
    """Its stages logged no output for the positions they attached. The stage that takes the failed one's place
    attaches the prefix from its own cache when it holds it (it served the prompt in its own chain, after other
    stages than this chain's: the same layers of the same build compute the same inputs); a cold one is rebuilt by
    the stages before it computing the prefix again (from token ids). Either way the stream is repaired, not
    replayed, the stages after the new one keep their caches, and it stays exact."""
    caplog.set_level(logging.INFO, logger="stagemesh.router")
    mesh = await start_mesh(tiny_model, [splits(2, 3, 3), splits(2, 3, 3)])
    try:
        ids = prompt(40, seed=91)
        for _ in range(8):  # two at a time, until both chains hold the prompt's blocks (bounded)
            await asyncio.gather(*(collect(mesh.router_stub.Generate(request(ids, 2))) for _ in range(2)))
            if all(c[0].pool.cached_blocks for c in mesh.stages):
                break
        assert all(c[0].pool.cached_blocks == 2 for c in mesh.stages)
        # The warm-up's sessions closed first (the router closes them a moment after their streams end): waiting for
        # that once the stream below runs would let it finish before its stage stops.
        await until(lambda: not any(s.sessions.sessions for c in mesh.stages for s in c), 30, "warm-up sessions closed")
        call = mesh.router_stub.Generate(request(ids, 12))
        got = []
        while len(got) < 4:
            got.extend((await call.read()).token_ids)
        chain = next(c for c in mesh.stages if c[1].sessions.sessions)
        other = next(c for c in mesh.stages if c is not chain)
        assert [s.cache.attached for s in chain[0].sessions.sessions.values()] == [2 * BS]
        if replacement == "cold":
            assert other[dead].pool.forget_cached() == 2
        kept = [next(iter(s.sessions.sessions.values())).cache for s in chain[dead + 1:]]
        await chain[dead].stop(0)
        while (response := await call.read()) is not grpc.aio.EOF:
            got.extend(response.token_ids)
            last = response
        assert got == hf_greedy(hf_models["llama"], ids, 12)
        assert "takes its place" in caplog.text and "replaying" not in caplog.text
        assert last.cached_tokens == 2 * BS
        assert [c.length for c in kept] == [len(ids) + 11] * len(kept)  # the stages after it kept their caches
        rebuilt = [s.cache.attached for s in other[dead].sessions.sessions.values()]
        assert rebuilt == [2 * BS if replacement == "holds the prefix" else 0]
    finally:
        await mesh.stop()


async def test_an_output_log_covers_every_position_unless_the_session_started_from_the_cache(tiny_model):
    """Repair rebuilds a stage from the one before's log of positions 0 on: a stage that attached blocks but was
    rewound to 0 at the first step (the next stage had none) logs them all; one that started past 0 has no log."""
    mesh = await start_mesh(tiny_model, [splits(3, 5)], router=False)
    chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
    ids = prompt(40, seed=60)

    async def logged(session) -> int | grpc.StatusCode:
        read = chain.stages[0].stub.ReadOutput(stage_pb2.ReadOutputRequest(session_id=session.session_id,
                                                                           end=len(ids)))
        try:
            return sum(c.hidden.shape[0] for c in [c async for c in read])
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    try:
        await _logits_after([chain.stages[0].address], ids, ids[:-1], answers=False)  # the first stage alone: 2 blocks
        for started in (0, 2 * BS):  # the second stage had nothing, then the blocks the first session left
            async with ChainSession(chain, max_length=64, request_id="log", keep_output=True,
                                    prefix_ids=ids[:-1]) as session:
                assert session.position == started
                await session.step(ids[started:], sampling=Sampling())
                assert await logged(session) == (len(ids) if not started else grpc.StatusCode.FAILED_PRECONDITION)
    finally:
        for stage in chain.stages:
            await stage.close()
        await mesh.stop()
