"""The per-step breakdown: a stage times each phase of its steps (wire decode, batch assembly, model, sampling,
encode), reports the totals in Stage/Info and observes them in stagemesh_stage_step_phase_seconds."""

from __future__ import annotations

from prometheus_client import REGISTRY

from stagemesh.stage_server.engine.step_timing import PHASES
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import collect, splits, start_mesh


async def test_stages_report_where_step_time_goes(tiny_model):
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        before = REGISTRY.get_sample_value("stagemesh_stage_step_phase_seconds_count", {"phase": "model"}) or 0
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6, 7],
                                                                                       max_new_tokens=6)))
        assert len(got) == 6
        for index, wanted in ((0, {"wire_decode", "assemble", "model", "encode"}), (1, set(PHASES))):
            info = await mesh.stage_stub(0, index).Info(stage_pb2.InfoRequest())
            assert info.decode_steps == 5  # after the prompt's step; warm-up passes are not steps
            timed = {phase for phase, seconds in info.decode_phase_seconds.items() if seconds > 0}
            assert timed == wanted  # only the last stage samples
        after = REGISTRY.get_sample_value("stagemesh_stage_step_phase_seconds_count", {"phase": "model"})
        assert after - before >= 12  # both stages' passes, prefill too (one process here)
    finally:
        await mesh.stop()
