"""CUDA graphs for every pass, the memory plan that sizes the KV pool around them, and --max-model-len
(stage_server/gpu/cuda_graphs.py, stage_server/engine/memory_plan.py).

What a machine without a GPU can check here: the buckets, the memory arithmetic and its refusal, that graphs need
the ragged attention kernel, that a CPU stage serves eager, and --max-model-len's bound on sessions. The padded
buffers themselves are checked against transformers through Triton's interpreter (tests/triton_interpreted.py);
on a CUDA machine scripts/gpu_check.sh replays captured graphs."""

from __future__ import annotations

import grpc
import pytest

from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import load_stage
from stagemesh.stage_server.engine.memory_plan import NoRoomForPool, gpu_pool_bytes, split_room
from stagemesh.stage_server.gpu.cuda_graphs import GraphedPasses, bucket, powers_of_two
from stagemesh.v1 import router_pb2, stage_pb2
from tests.conftest import collect, hf_greedy, splits, start_mesh
from tests.test_exactness import prompt

GIB = 2**30


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert powers_of_two(1, 128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert powers_of_two(16, 2048)[-1] == 2048 and powers_of_two(2, 5) == [2, 4, 8]
    assert bucket(3, [1, 2, 4]) == 4 and bucket(4, [1, 2, 4]) == 4 and bucket(5, [1, 2, 4]) is None


def test_the_pool_takes_what_the_utilization_leaves_after_weights_activations_and_graphs():
    # 80 GiB at 0.9 = 72 GiB; 16 GiB of weights; 2 GiB of activations, counted twice with graphs.
    assert gpu_pool_bytes(80 * GIB, 16 * GIB, 2 * GIB, 0.9, graphs=True) == 72 * GIB - 16 * GIB - 4 * GIB
    assert gpu_pool_bytes(80 * GIB, 16 * GIB, 2 * GIB, 0.9, graphs=False) == 72 * GIB - 16 * GIB - 2 * GIB
    with pytest.raises(NoRoomForPool, match="no room for a KV pool.*--gpu-memory-utilization"):
        gpu_pool_bytes(80 * GIB, 70 * GIB, 2 * GIB, 0.9, graphs=True)


def test_the_repair_log_shares_the_pools_room_position_for_position():
    """An 8B stage of 16 layers: 64 KiB of KV and 8 KiB of log per position (bfloat16). By default the room is
    split so that the pool and the log hold as many positions each; a log asked for with at most that many is taken
    from the room beside the pool, one asked for with more goes to the host (the pool keeps the whole room); none on
    a last stage (log bytes 0) or with --repair-log-tokens 0."""
    kv, row = 64 * 1024, 8 * 1024
    pool, tokens, beside = split_room(9 * GIB, kv, row, None)
    assert (tokens, beside) == (9 * GIB // (kv + row), True) and pool // kv == tokens and pool + tokens * row <= 9 * GIB
    assert split_room(9 * GIB, kv, row, 1000) == (9 * GIB - 1000 * row, 1000, True)
    assert split_room(9 * GIB, kv, row, tokens + 1) == (9 * GIB, tokens + 1, False)
    assert split_room(9 * GIB, kv, 0, None) == (9 * GIB, 0, False)
    assert split_room(9 * GIB, kv, row, 0) == (9 * GIB, 0, False)


@pytest.mark.parametrize("field,value,says", [("gpu_memory_utilization", 0.0, "share of the GPU"),
                                              ("gpu_memory_utilization", 1.5, "share of the GPU"),
                                              ("max_model_len", 0, ">= 1 position"),
                                              ("repair_log_tokens", -1, ">= 0 positions")])
def test_bad_memory_flags_are_refused_by_name(tiny_model, field, value, says):
    with pytest.raises(ValueError, match=says):
        StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, **{field: value})


def test_graphs_of_every_pass_need_the_ragged_kernel(tiny_model):
    model = load_stage(tiny_model, 0, None)
    a = model.args
    pool = KVPool(1 << 22, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, block_size=4)
    with pytest.raises(ValueError, match="ragged attention kernel"):
        GraphedPasses(model, pool, max_tokens=32, max_len=64, capture=False)


async def test_a_cpu_stage_serves_eager_and_admits_sessions_up_to_max_model_len(tiny_models, hf_models):
    mesh = await start_mesh(tiny_models["llama"], [splits(4, 4)], stage_options={"max_model_len": 64})
    try:
        assert all(s.model.pass_graphs is None for s in mesh.all_stages())
        ids = prompt(12, seed=5)
        got, _, _ = await collect(mesh.router_stub.Generate(router_pb2.GenerateRequest(token_ids=ids,
                                                                                       max_new_tokens=8)))
        assert got == hf_greedy(hf_models["llama"], ids, 8)
        stub = mesh.stage_stub(0, 0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="long", max_length=65))
        assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE and "1..64" in refused.value.details()
        await stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="fits", max_length=64))
        await stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="fits"))
    finally:
        await mesh.stop()
