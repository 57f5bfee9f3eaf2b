"""Where stagemesh's CPU kernels cannot be had, a stage runs torch's ops and stays exact: the path a host without a
compiler takes, chosen here on purpose with STAGEMESH_CPU_KERNELS=0, in real processes. And the kernels' cache
is trusted only where this user alone may write: a library another user could have put there is never loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from stagemesh.launcher import LocalMesh, stage_env
from stagemesh.stage_server.cpu import cpu_kernels
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import hf_greedy
from tests.harness.fault_mesh import free_ports
from tests.test_exactness import prompt


def infos(ports: list[int]) -> list[stage_pb2.StageInfo]:
    out = []
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            out.append(stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10))
    return out


@pytest.mark.parametrize("kernels", ["0", "1"], ids=["kernels-off", "kernels-on"])
def test_a_chain_serves_transformers_tokens_with_and_without_the_cpu_kernels(tiny_model, hf_models, tmp_path,
                                                                              kernels):
    if kernels == "1" and not cpu_kernels.load():
        pytest.skip("the CPU kernels could not be built here (tests/test_paged_attention.py says why)")
    mesh = LocalMesh(str(tiny_model), tmp_path)
    ports = free_ports(2)
    env = {**stage_env(1), cpu_kernels.OFF_ENV: kernels}
    try:
        mesh.spawn_together([(f"stage{i}", ["stage", "--model", str(tiny_model), "--layers", layers, "--port",
                                            str(port), "--threads", "1"])
                             for i, (layers, port) in enumerate(zip(("0:3", "3:8"), ports, strict=True))], env)
        router = mesh.spawn("router", ["router", "--model", str(tiny_model), "--port", "0", "--chain",
                                       ",".join(f"127.0.0.1:{p}" for p in ports)], env)
        ids = prompt(14, seed=21)
        with grpc.insecure_channel(router.address) as channel:
            got = [t for r in router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=12), timeout=120) for t in r.token_ids]
        assert got == hf_greedy(hf_models["llama"], ids, 12)
        served = infos(ports)
        on = kernels == "1"
        assert [i.attention_kernel for i in served] == ["cpu" if on else ""] * 2
        assert [i.packed_weights for i in served] == [on] * 2
    finally:
        mesh.stop()


def test_a_kernel_cache_others_may_write_to_is_never_loaded_from(tmp_path):
    cache = tmp_path / "stagemesh" / "kernels"
    cache.mkdir(parents=True)
    os.chmod(cache, 0o777)
    probe = "from stagemesh.stage_server.cpu import cpu_kernels; print(cpu_kernels.load())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    env.pop(cpu_kernels.OFF_ENV, None)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
    assert "writable by others" in done.stderr
    assert not list(cache.rglob("*.so")), "a library was built into it"


def test_the_ownership_check_passes_a_private_folder_and_refuses_a_shared_one(tmp_path):
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    os.chmod(shared, 0o775)
    cpu_kernels._check_owned(private)
    with pytest.raises(PermissionError, match="writable by others"):
        cpu_kernels._check_owned(shared)


@pytest.mark.parametrize("kernels", ["0", "1"], ids=["kernels-off", "kernels-on"])
def test_stagemesh_kernels_builds_them_ahead_or_says_why_not(kernels):
    if kernels == "1" and not cpu_kernels.load():
        pytest.skip("the CPU kernels could not be built here (tests/test_paged_attention.py says why)")
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "kernels"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, cpu_kernels.OFF_ENV: kernels})
    if kernels == "1":
        assert done.returncode == 0 and "CPU kernels: ready (" in done.stdout and ".so)" in done.stdout, done.stderr
    else:
        assert done.returncode == 1 and "not built (STAGEMESH_CPU_KERNELS=0)" in done.stdout, done.stderr
