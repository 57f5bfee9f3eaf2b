"""int8 weights: the stage serves, with logits close to float32's (the full accuracy report is
scripts/bench_levers.py)."""

from __future__ import annotations

import pytest
import torch

from router.chain_client import Chain, ChainSession, StageEndpoint
from stage_server.model import load_stage
from stage_server.quantize import quantize
from stagemesh import tensor_codec
from stagemesh.v1 import stage_pb2
from tests.conftest import splits, start_mesh


async def last_logits(mesh, ids: list[int]) -> torch.Tensor:
    chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
    try:
        async with ChainSession(chain, 64, "quantize-test") as session:
            response = await session.step(ids, sampling=stage_pb2.SamplingParams(), return_logits=True)
            return tensor_codec.decode(response.logits)
    finally:
        for s in chain.stages:
            await s.close()


async def test_int8_stage_serves_logits_close_to_float32(tiny_model):
    ids = list(range(10, 40))
    logits = {}
    for how in ("none", "int8"):
        mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False, stage_options={"quantize": how})
        try:
            logits[how] = await last_logits(mesh, ids)
        finally:
            await mesh.stop()
    assert (logits["int8"] - logits["none"]).abs().max() < 0.2
    assert not torch.equal(logits["int8"], logits["none"])  # it really ran quantized


def test_int8_needs_float32_on_cpu(tiny_model):
    with pytest.raises(ValueError, match="float32"):
        quantize(load_stage(tiny_model, 0, 8, dtype=torch.bfloat16), "int8")
