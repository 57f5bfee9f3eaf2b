"""A router's view of its chains: a chain marked down because a stream on it failed stays down until a health
check that began after the failure passes; a check already in flight when the stream failed, which saw the
stage alive a moment earlier, does not bring it back (it did: the router then sent new streams to a dead stage
until the next check, and a test of the etcd mesh saw a killed stage's chain counted as usable)."""

from __future__ import annotations

import asyncio

from stagemesh.checkpoint import model_fingerprint
from stagemesh.router.chains import ChainSet, parse_chain
from tests.conftest import splits, start_mesh, until
from tests.harness.link_proxy import LinkProxy


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
