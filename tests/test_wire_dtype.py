"""Hidden states may travel between stages in bfloat16 or int8: fewer bytes, a small, bounded error."""

from __future__ import annotations

import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.router.chain_client import Chain, StageEndpoint
from stagemesh.router.session import ChainSession
from stagemesh.router.step_values import Sampling
from stagemesh.v1 import stage_pb2
from stagemesh.wire import encode_ids
from tests.conftest import StageSessions, splits, start_mesh, until


def test_int8_rows_keep_their_scale_and_a_half_step_error():
    h = torch.randn(5, 64) * torch.tensor([0.01, 1.0, 30.0, 1e3, 1e-4])[:, None]
    msg = tensor_codec.encode_hidden(h, "int8")
    assert msg.dtype == "int8" and len(msg.data) == h.numel() and len(msg.row_scale) == 5
    back = tensor_codec.decode(msg)
    step = h.abs().amax(dim=1, keepdim=True) / 127
    assert back.dtype == torch.float32
    assert ((back - h).abs() <= step / 2 * 1.0001).all()


def test_bad_row_scale_is_refused():
    msg = tensor_codec.encode(torch.zeros(2, 3))
    msg.row_scale.extend([1.0, 1.0])
    with pytest.raises(tensor_codec.CodecError):
        tensor_codec.decode(msg)


@pytest.mark.parametrize("wire, max_logit_error, bytes_per_value", [
    ("", 1e-4, 4), ("bfloat16", 0.05, 2), ("int8", 0.05, 1)], ids=["float32", "bfloat16", "int8"])
async def test_wire_dtype_between_stages(tiny_model, hf_models, wire, max_logit_error, bytes_per_value):
    """A prompt's logits, its hidden states sent between the two stages in this wire dtype, within
    max_logit_error of transformers' forward pass over the whole model (float32 on the wire: the suite's 1e-4)."""
    ids = list(range(10, 30))
    with torch.inference_mode():
        expected = hf_models["llama"](torch.tensor([ids])).logits[0, -1]
    mesh = await start_mesh(tiny_model, [splits(4, 4)], router=False)
    chain = Chain([StageEndpoint(s.address) for s in mesh.stages[0]])
    try:
        async with ChainSession(chain, 64, f"wire-{wire}", wire_dtype=wire) as session:
            r = await session.step(ids, sampling=Sampling(), return_logits=True)
            logits = tensor_codec.decode(r.logits)
        torch.testing.assert_close(logits, expected, atol=max_logit_error, rtol=0)
        first = mesh.stage_stub(0, 0)
        # What the first stage sends on for a session of this wire dtype: its output log holds the same encoding.
        await first.OpenSession(stage_pb2.OpenSessionRequest(session_id="probe", max_length=8, wire_dtype=wire,
                                                             keep_output=True))
        call = StageSessions(first)
        await call.send(steps=[stage_pb2.ForwardRequest(session_id="probe", start=0, token_ids=encode_ids([5, 6]))])
        probe = mesh.stages[0][0].sessions.sessions["probe"]
        await until(lambda: probe.output.length == 2, 30, "the probe's step ran")
        [chunk] = [c async for c in first.ReadOutput(stage_pb2.ReadOutputRequest(session_id="probe", end=2))]
        assert len(chunk.hidden.data) == 2 * 256 * bytes_per_value
        call.cancel()
    finally:
        for s in chain.stages:
            await s.close()
        await mesh.stop()
