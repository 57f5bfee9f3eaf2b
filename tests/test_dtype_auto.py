"""--dtype auto: the checkpoint's dtype unless told otherwise, on stages and in the scheduler's plan alike (the
scheduler sizes weights as the live stages announce them), so that nobody repeats it by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stagemesh.checkpoint import ModelFootprint, serving_dtype
from stagemesh.discovery.backends import open_registry
from stagemesh.discovery.registry import ServiceRecord, ServiceStatus
from stagemesh.scheduler.scheduler import Scheduler, SchedulerConfig
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.server import StageServer
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import stage_pb2
from tests.conftest import collect, hf_greedy, start_mesh
from tests.test_exactness import prompt
from tests.test_traffic import request


@pytest.mark.parametrize("stored,device,serves", [
    ("float32", "cpu", "float32"), ("float32", "cuda", "bfloat16"), ("bfloat16", "cpu", "bfloat16"),
    ("bfloat16", "cuda", "bfloat16"), ("float16", "cuda", "float16"), ("torch.float16", "cpu", "float16"),
    (None, "cpu", "float32"), (None, "cuda", "bfloat16"), ("float64", "cpu", "float32"),
])
def test_auto_takes_the_checkpoints_dtype_and_bfloat16_for_float32_on_cuda(stored, device, serves):
    config = {} if stored is None else {"torch_dtype": stored}
    assert serving_dtype("auto", config, device) == serves
    assert serving_dtype("float16", config, device) == "float16"  # a dtype given is kept


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bf16") / "tiny-bf16", "llama", layers=4, seed=3,
                           dtype="bfloat16")


async def test_a_bfloat16_checkpoint_is_served_in_bfloat16_on_a_cpu_stage(bf16_model):
    stage = StageServer(StageConfig(model=str(bf16_model), layer_start=0, layer_end=4, port=0, kv_cache_gb=0.05))
    try:
        await stage.start(stage.load(0, 4))
        assert stage.model.dtype == torch.bfloat16 and stage.pool.dtype == torch.bfloat16
        assert stage.fingerprint.rsplit("/", 1)[0].endswith("/bfloat16/none")
        info = await stage.slot.current.Info(stage_pb2.InfoRequest(), None)
        assert info.fingerprint == stage.fingerprint
    finally:
        await stage.stop(0)


async def test_the_bfloat16_stage_decodes_as_transformers_does_in_bfloat16(bf16_model):
    mesh = await start_mesh(bf16_model, [[(0, 2), (2, 4)]])
    try:
        ids = prompt(12, seed=5)
        got, _, _ = await collect(mesh.router_stub.Generate(request(ids, 8)))
    finally:
        await mesh.stop()
    hf = AutoModelForCausalLM.from_pretrained(bf16_model, dtype=torch.bfloat16).eval()
    assert got == hf_greedy(hf, ids, 8)


def _announcing(dtype: str, quantize: str = "none", passing: bool = True) -> ServiceStatus:
    return ServiceStatus(ServiceRecord(f"stage-{dtype}-{quantize}-{passing}", "127.0.0.1:1", "m",
                                       {"dtype": dtype, "quantize": quantize, "budget_bytes": "1000000"}), passing)


def test_the_scheduler_sizes_weights_as_the_live_stages_announce_them(tiny_model):
    scheduler = Scheduler(SchedulerConfig(model=str(tiny_model), registry_port=0), open_registry("local://127.0.0.1:1"))
    float32 = ModelFootprint.from_model_dir(tiny_model, "float32")
    assert scheduler.footprint == float32  # before any stage announces: the checkpoint's own
    announced = [_announcing("bfloat16"), _announcing("bfloat16"), _announcing("float32"),
                 _announcing("float32", passing=False), _announcing("float32", passing=False),
                 _announcing("bogus"), _announcing("bogus")]
    assert scheduler.sizing(announced) == ("bfloat16", "none")
    assert scheduler.footprint_for(announced).layer_bytes * 2 == float32.layer_bytes
    assert scheduler.sizing([_announcing("float32", "int8-weight-only")]) == ("float32", "int8-weight-only")
    fixed = Scheduler(SchedulerConfig(model=str(tiny_model), dtype="float16", quantize="none", registry_port=0),
                      open_registry("local://127.0.0.1:1"))
    assert fixed.sizing(announced) == ("float16", "none")  # flags given win
