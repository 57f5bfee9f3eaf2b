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


async def test_the_client_carries_the_sampling_api(tiny_model):
    """Issue 47's fields through the client: logprobs per token, the seed on the first piece (the router's when
    none was given, which reproduces the stream), usage on the last, and model_info()."""
    mesh = await start_mesh(tiny_model, [splits(8)])
    try:
        ids = prompt(8, seed=32)

        def calls():
            with Client(mesh.router.address) as client:
                drawn = list(client.generate(ids, max_new_tokens=6, temperature=0.9, repetition_penalty=1.2,
                                             logprobs=True, top_logprobs=2))
                again = list(client.generate(ids, max_new_tokens=6, temperature=0.9, repetition_penalty=1.2,
                                             seed=drawn[0].seed))
                return drawn, again, client.model_info()

        drawn, again, info = await asyncio.to_thread(calls)
        assert drawn[0].seed is not None and all(p.seed is None for p in drawn[1:])
        assert [t for p in again for t in p.token_ids] == [t for p in drawn for t in p.token_ids]
        assert all(len(p.logprobs) == len(p.token_ids) for p in drawn)
        assert all(lp.logprob <= 0 and len(lp.top) == 2 for p in drawn for lp in p.logprobs)
        assert drawn[-1].usage.prompt_tokens == 8 and drawn[-1].usage.completion_tokens == 6
        assert all(p.usage is None for p in drawn[:-1])
        assert (info.model, info.vocab_size, info.eos_token_ids, info.chat_template) == (tiny_model.name, 1000,
                                                                                          (1,), False)
        assert info.context_length > 0 and info.fingerprint
    finally:
        await mesh.stop()


def test_the_client_needs_no_torch():
    probe = "import sys, stagemesh.client; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
