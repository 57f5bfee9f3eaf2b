"""A router's view of its chains: a chain marked down because a stream on it failed stays down until a health
check that began after the failure passes; a check already in flight when the stream failed, which saw the
stage alive a moment earlier, does not bring it back (it did: the router then sent new streams to a dead stage
until the next check, and a test of the etcd mesh saw a killed stage's chain counted as usable)."""

from __future__ import annotations

import asyncio

import grpc

from stagemesh import metrics
from stagemesh.checkpoint import model_fingerprint
from stagemesh.discovery.chain_table import PublishedChain, PublishedStage
from stagemesh.router.chain_client import Progress
from stagemesh.router.chain_probe import ChainProbeConfig
from stagemesh.router.chains import ChainSet, parse_chain
from stagemesh.router.generation import GenerationConfig
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from tests.conftest import hf_greedy, splits, start_mesh, until
from tests.harness.link_proxy import LinkProxy
from tests.test_exactness import prompt
from tests.test_traffic import request


async def test_a_check_in_flight_when_a_chain_fails_does_not_bring_it_back(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False)
    link = LinkProxy(mesh.stages[0][0].address).start()  # slows the check down, so that the failure lands mid-check
    spec = f"{link.address},{mesh.stages[0][1].address}"
    chains = ChainSet([parse_chain(spec)], 8, model_fingerprint(str(tiny_model)))
    chain = chains.chains[0]
    try:
        await chains.refresh()
        assert chain.healthy
        link.set(delay_s=0.15)  # each way: the check's two calls to the first stage take ~0.6 s, within its timeout
        sent = link.bytes_in
        check = asyncio.ensure_future(chains.refresh())
        await until(lambda: link.bytes_in > sent, 10, "the check's first call reached the link", every=0.005)
        chains.mark_down(chain, "UNAVAILABLE: a stream on it failed")
        assert not check.done()  # its calls are still on the slow link
        await check
        assert not chain.healthy, "a check that began before the failure brought the chain back"
        link.set()
        await chains.refresh()  # a check begun after the failure decides: the stage answers, so the chain is up
        assert chain.healthy
    finally:
        for stage in chain.stages:
            await stage.close()
        link.stop()
        await mesh.stop()


async def test_a_chain_held_by_its_probe_stays_held_when_withdrawn_and_published_again(tiny_model):
    """The scheduler withdraws a chain its probe holds down (a partition between its stages also cut their etcd
    members apart) and publishes it again while the partition lasts: the same id is the same stages and ranges, so
    the path between them is no less broken. It stays held (its stages' own checks pass) until a probe passes; it
    did not: adopted afresh, its first check passed, and streams went to it until its probes failed again."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False)
    published = PublishedChain(tuple(PublishedStage(f"s{i}", stage.address, a, b)
                                     for i, (stage, (a, b)) in enumerate(zip(mesh.stages[0], splits(4, 4),
                                                                             strict=True))))
    chains = ChainSet([], 8, model_fingerprint(str(tiny_model)))
    try:
        await chains.adopt([published])
        assert [c.healthy for c in chains.chains] == [True]
        chains.hold(chains.chains[0], "its end-to-end probe failed 2 times in a row")
        await chains.adopt([])  # withdrawn: no stream on it, so its channels close
        assert not chains.chains
        await chains.adopt([published])  # published again, the partition not healed
        chain = chains.chains[0]
        await chains.refresh()
        assert not chain.healthy and chain.chain_id in chains.held, "a held chain came back without a probe"
        assert "end-to-end probe" in chain.problem
        chains.unhold(chain)  # a probe passed
        await chains.refresh()
        assert chain.healthy
    finally:
        await chains.close()
        await mesh.stop()


async def test_health_checks_go_on_after_a_chain_is_withdrawn_while_its_check_waits(tiny_model):
    """The scheduler withdraws a chain while the router's check of it waits on a stage that does not answer (its
    host cut off): the withdrawal closes the chain's channels, which cancels the check's call under it. The checks
    of every chain go on: they stopped (the cancellation ended the health loop), and a chain published later, or
    one marked down, never came back: a netns test saw chain B listed but never healthy after its host's cut."""
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(4, 4)], router=False)
    link = LinkProxy(mesh.stages[1][0].address).start()
    stages = [PublishedChain(tuple(PublishedStage(f"s{i}", address, a, b)
                                   for i, (address, (a, b)) in enumerate(zip(addresses, splits(4, 4), strict=True))))
              for addresses in ([s.address for s in mesh.stages[0]], [link.address, mesh.stages[1][1].address])]
    chains = ChainSet([], 8, model_fingerprint(str(tiny_model)))
    watch = asyncio.ensure_future(chains.watch(0.05))
    try:
        await chains.adopt(stages)
        await until(lambda: all(c.healthy for c in chains.chains), 30, "both chains up")
        kept, withdrawn = chains.chains
        link.set(delay_s=0.4)  # each way: its checks now wait on the link
        sent = link.bytes_in
        await until(lambda: link.bytes_in > sent, 10, "a check's call reached the slow link", every=0.005)
        chains.replace([stages[0]])  # withdrawn mid-check: no stream on it, so its channels close now
        await asyncio.sleep(0.5)
        assert not watch.done(), f"the health loop ended: {watch.exception() if not watch.cancelled() else 'cancelled'}"
        chains.mark_down(kept, "UNAVAILABLE: a stream on it failed")
        await until(lambda: kept.healthy, 30, "the chain marked down back by the next check that passes")
        assert withdrawn.withdrawn
    finally:
        watch.cancel()
        await chains.close()
        link.stop()
        await mesh.stop()


def _probes(result: str) -> float:
    return metrics.CHAIN_PROBES.labels(result)._value.get()


async def test_a_black_holed_link_between_two_stages_takes_the_chain_out_by_its_probe(tiny_model, hf_models, caplog):
    """Issue 46: the link from a chain's first stage to its second black-holed, while the router reaches both
    directly (their own health checks pass). The chain's end-to-end probe fails, the chain is taken out and its
    stream in flight fails over at once (the progress timeout is 600 s here: only the probe can move it in time)
    and finishes exact on the other chain; the chain stays out while the link is down, whatever its stages' checks
    say, and comes back once the link heals. The probes leave no session or KV block on any stage."""
    mesh = await start_mesh(tiny_model, [splits(4, 4), splits(4, 4)],
                            router_options={"probe": ChainProbeConfig(probe_interval_s=0.2),
                                            "generation": GenerationConfig(step_timeout_s=600)})
    chains = mesh.router.chains
    links = []
    try:
        for chain in chains.chains:  # the router keeps its channel to the last stage, dialled directly; the address
            last = chain.stages[1]   # it names to the first stage as its next goes through a link
            last.channel  # noqa: B018
            links.append(LinkProxy(last.address).start())
            last.address = links[-1].address
        await until(lambda: all(c.healthy for c in chains.chains), 30, "both chains up")
        ids = prompt(12, seed=46)
        expected = hf_greedy(hf_models["llama"], ids, 40)
        failovers, timeouts = metrics.FAILOVERS._value.get(), metrics.STEP_TIMEOUTS._value.get()
        failed = _probes("fail")
        got, broken = [], None
        async with asyncio.timeout(120):  # the stream waiting out its progress timeout would take 600 s
            async for r in mesh.router_stub.Generate(request(ids, 40), timeout=600):
                got.extend(r.token_ids)
                if broken is None:
                    broken = next(i for i, c in enumerate(chains.chains) if c.in_flight)
                    links[broken].set(black_hole=True)
        chain = chains.chains[broken]
        assert got == expected
        assert not chain.healthy and chain.chain_id in chains.held, "the probe took the chain out"
        assert metrics.FAILOVERS._value.get() - failovers == 1
        assert _probes("fail") - failed >= 2
        # Failed probes count their own timeouts; no stream step waited out one.
        assert metrics.STEP_TIMEOUTS._value.get() - timeouts <= _probes("fail") - failed
        assert any(getattr(r, "request_id", "").startswith("probe-") for r in caplog.records), "probes log their id"

        seen = _probes("fail")
        for _ in range(3000):  # probes of the held chain keep failing: it does not come back meanwhile
            assert not chain.healthy, "the chain came back while its link was down"
            if _probes("fail") >= seen + 3:
                break
            await asyncio.sleep(0.01)
        links[broken].set()
        await until(lambda: chain.healthy, 30, "the chain back once its link healed")
        assert chain.chain_id not in chains.held
        infos = await mesh.settled_infos()
        assert all(i.open_sessions == 0 and i.kv_blocks_used == 0 for i in infos), infos
    finally:
        await mesh.stop()
        for link in links:
            link.stop()


async def test_a_chain_marked_down_ends_the_steps_in_flight_on_it_at_once(tiny_model):
    """The steps of two sessions stuck on a chain (its last stage's link black-holed; their progress timeout is
    600 s) end UNAVAILABLE as soon as the chain is marked down, naming no stage (so their streams replay
    elsewhere); a session opened on the chain afterwards is not touched by it."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False)
    link = LinkProxy(mesh.stages[0][1].address).start()
    chains = ChainSet([parse_chain(f"{mesh.stages[0][0].address},{link.address}")], 8,
                      model_fingerprint(str(tiny_model)))
    chain = chains.chains[0]
    slow = Progress(floor_s=600)
    try:
        async with (ChainSession(chain, 64, "stuck-1", progress=slow) as one,
                    ChainSession(chain, 64, "stuck-2", progress=slow) as two):
            assert chain.sessions == {one, two}
            token = (await one.step(prompt(5, seed=1), sampling=Sampling())).token_id
            link.set(black_hole=True)
            steps = [one.step_ahead([token], sampling=Sampling()),
                     two.step_ahead(prompt(5, seed=2), sampling=Sampling())]
            await asyncio.sleep(0.2)
            assert not any(s.done() for s in steps)
            chains.mark_down(chain, "a test took it out")
            async with asyncio.timeout(30):
                failures = await asyncio.gather(*steps, return_exceptions=True)
            assert all(isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.UNAVAILABLE
                       and "a test took it out" in f.details() for f in failures), failures
            assert one.failed_stage is None and two.failed_stage is None, "no stage is blamed: a replay, no repair"
        assert not chain.sessions
        link.set()
        async with ChainSession(chain, 64, "after", progress=slow) as after:
            assert (await after.step(prompt(5, seed=1), sampling=Sampling())).token_id == token
    finally:
        for stage in chain.stages:
            await stage.close()
        link.stop()
        await mesh.stop()


async def test_a_probe_stuck_behind_a_queue_while_streams_get_through_does_not_take_the_chain_out(
        tiny_model, hf_models, monkeypatch):
    """The first stage holds every probe's step back 5 s (a queue the stages have not reported yet), far past the
    probes' deadline, while a stream on the chain gets its tokens: the probes fail, but traffic gets through the
    chain end to end, so they do not count. The chain stays in service, its stream is neither aborted nor failed
    over (it has no other chain: an abort would fail it) and its tokens are exact."""
    mesh = await start_mesh(tiny_model, [splits(4, 4)],
                            router_options={"probe": ChainProbeConfig(probe_interval_s=0.1, probe_timeout_s=0.2)})
    chain = mesh.router.chains.chains[0]
    first = mesh.stages[0][0]
    submit = first.batcher.submit

    async def probes_held_up(req):
        # Probes wait 5 s, the stream's steps 40 ms each: it outlasts several probe deadlines (0.2 s + margin).
        await asyncio.sleep(5.0 if req.session.request_id.startswith("probe-") else 0.04)
        return await submit(req)

    try:
        await until(lambda: chain.healthy, 30, "the chain up")
        ids = prompt(12, seed=7)
        expected = hf_greedy(hf_models["llama"], ids, 150)
        failovers, failed = metrics.FAILOVERS._value.get(), _probes("fail")
        got, down = [], 0
        async with asyncio.timeout(120):
            async for r in mesh.router_stub.Generate(request(ids, 150), timeout=120):
                if not got:
                    monkeypatch.setattr(first.batcher, "submit", probes_held_up)
                got.extend(r.token_ids)
                down += not chain.healthy
        assert got == expected
        assert _probes("fail") - failed >= 2, "the probes failed meanwhile (else this test proves nothing)"
        assert metrics.FAILOVERS._value.get() == failovers and not down, "traffic got through: the chain stayed up"
        assert chain.chain_id not in mesh.router.chains.held
    finally:
        await mesh.stop()
