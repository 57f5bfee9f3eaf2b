"""stagemesh.client: a Python caller's typed client of the router, on the base install (no torch)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from stagemesh.client import Client
from tests.conftest import hf_greedy, splits, start_mesh
from tests.test_exactness import prompt


async def test_the_client_streams_transformers_tokens_and_lists_the_chains(tiny_model, hf_models):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        ids = prompt(10, seed=31)

        def calls():
            with Client(mesh.router.address) as client:
                pieces = list(client.generate(ids, max_new_tokens=9))
                whole = client.complete(ids, max_new_tokens=9)
                texted = client.complete("Once upon a time", max_new_tokens=4)
                chains = client.chains()
                early = client.generate(ids, max_new_tokens=400)
                next(early)
                early.close()  # leaving the stream early cancels it
            return pieces, whole, texted, chains

        pieces, whole, texted, chains = await asyncio.to_thread(calls)
        want = hf_greedy(hf_models["llama"], ids, 9)
        assert [t for p in pieces for t in p.token_ids] == want == whole[0]
        assert pieces[-1].finish_reason == "length" and all(p.finish_reason == "" for p in pieces[:-1])
        assert whole[2] == "length" and len(texted[0]) == 4 and texted[1]
        assert [(c.healthy, len(c.stages)) for c in chains] == [(True, 2)]
        assert [(i.open_sessions, i.kv_used_bytes) for i in await mesh.settled_infos()] == [(0, 0)] * 2
    finally:
        await mesh.stop()


def test_the_client_needs_no_torch():
    probe = "import sys, stagemesh.client; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
