"""--compile: torch.compile (inductor) of each layer's MLP and norms and the LM head stays exact (greedy tokens
identical to transformers, logits within 1e-4 in float32) for every family over a 2-stage split; a compilation
that fails leaves the stage serving eager. Marked `compile`: each stage compiles in its warm-up (a few seconds
per stage on 2 cores once inductor's cache is warm, ~20 s the first time)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._inductor.config as inductor_config

from stage_server.compiled import is_compiled
from stagemesh.v1 import router_pb2
from tests.conftest import FAMILIES, collect, hf_greedy, splits, start_mesh, stepped_logits
from tests.test_exactness import prompt

pytestmark = pytest.mark.compile


async def greedy_and_logits(mesh, n_tokens: int, ids: list[int]) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """(router's greedy tokens, per-step logits through a ChainSession, that session's tokens)."""
    got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                   max_new_tokens=n_tokens)))
    tokens, logits = await stepped_logits([s.address for s in mesh.stages[0]], ids, 6, "compile-test")
    return got, logits, tokens


@pytest.mark.parametrize("family", FAMILIES)
async def test_compiled_split_is_exact(tiny_models, hf_models, family):
    mesh = await start_mesh(tiny_models[family], [splits(3, 5)], stage_options={"compile": True})
    try:
        assert all(is_compiled(s.model) for s in mesh.all_stages())  # compiled, not fallen back to eager
        ids = prompt(20, seed=31)
        got, logits, tokens = await greedy_and_logits(mesh, 24, ids)
        assert got == hf_greedy(hf_models[family], ids, 24)
        with torch.inference_mode():
            ref = hf_models[family](torch.tensor([ids + tokens])).logits[0]
        for k, row in enumerate(logits):
            torch.testing.assert_close(row, ref[len(ids) - 1 + k], atol=1e-4, rtol=0)
    finally:
        await mesh.stop()


async def test_a_failed_compilation_serves_eager(tiny_models, hf_models, monkeypatch, caplog):
    """No working C++ compiler for inductor (and no cached graph to fall back on): the warm-up's compilation
    fails, the stage logs it once and serves the same tokens eagerly."""
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
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
