"""The real commands, as separate processes: `stagemesh stage` x2 and `stagemesh router`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors import safe_open

from stagemesh.checkpoint import ModelFootprint
from stagemesh.grpc_transport import GRPC_TRANSPORT_EXPERIMENTS
from stagemesh.launcher import stage_budget_gb, stage_env, start_local_mesh, wait_for_chains
from stagemesh.router.server import RouterConfig
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def local_mesh(tiny_model, tmp_path_factory):
    mesh, router = start_local_mesh(str(tiny_model), stages=2, router_port=0,
                                    log_dir=tmp_path_factory.mktemp("logs"))
    yield mesh, router
    mesh.stop()
    assert all(p.popen.returncode is not None for p in mesh.processes)


def test_processes_serve_exact_tokens_and_report_their_slice(local_mesh, hf_models, tiny_model):
    mesh, router = local_mesh
    with grpc.insecure_channel(router.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = router_pb2_grpc.RouterStub(channel)
        prompt = [11, 12, 13, 14, 15]
        ids = [t for r in stub.Generate(router_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=16), timeout=30)
               for t in r.token_ids]
        assert ids == hf_greedy(hf_models["llama"], prompt, 16)
        chains = stub.ListChains(router_pb2.ListChainsRequest(), timeout=5).chains
        assert [(s.layer_start, s.layer_end) for s in chains[0].stages] == [(0, 4), (4, 8)]

    infos = []
    for proc in mesh.processes[:2]:
        with grpc.insecure_channel(proc.address) as channel:
            infos.append(stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=5))
    first, last = infos
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    # Each stage holds only its own slice: together exactly the checkpoint, each about half of it.
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        total = sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118
    assert first.weight_bytes + last.weight_bytes == total
    assert 0.4 * total < first.weight_bytes < 0.6 * total


def test_router_reports_not_serving_when_its_only_chain_dies(local_mesh):
    mesh, router = local_mesh
    mesh.processes[1].popen.kill()
    mesh.processes[1].popen.wait()
    with grpc.insecure_channel(router.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=4), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_kill_9_of_a_stage_withdraws_its_chain_and_a_spare_restores_it(tiny_model, tmp_path):
    mesh, router = start_local_mesh(str(tiny_model), stages=2, replicas=2, router_port=0, registry="local",
                                    log_dir=tmp_path)
    try:
        chains = wait_for_chains(router.address, 2, timeout=60)
        assert len(chains) == 2
        victim = next(p for p in mesh.processes if p.address == chains[0].stages[1].address)
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            t0 = time.monotonic()
            stub.ListChains(router_pb2.ListChainsRequest(), timeout=5)
            call_s = time.monotonic() - t0  # this machine's pace, now: one call to the router
            victim.popen.kill()  # SIGKILL: no goodbye to the registry
            t0 = time.monotonic()
            for _ in range(600):  # bounded: a minute and more
                listed = stub.ListChains(router_pb2.ListChainsRequest(), timeout=5).chains
                if [c.chain_id for c in listed if c.healthy] == [chains[1].chain_id]:
                    break
                time.sleep(0.1)
            took = time.monotonic() - t0
            assert [c.chain_id for c in listed if c.healthy] == [chains[1].chain_id]
            # The router's next health check (one a second) finds the stage gone; for the processes' calls on a
            # loaded machine, a hundred calls' time here, at least 4 s.
            bound = RouterConfig.health_interval_s + max(4.0, 100 * call_s)  # the default, which `up` runs
            assert took < bound, f"the chain was still in use {took:.1f}s after its stage was killed (> {bound:.1f}s)"
            ids = [t for r in stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=4), timeout=30)
                   for t in r.token_ids]
            assert len(ids) >= 1
        budget = f"{stage_budget_gb(str(tiny_model), 2, 'float32'):.6f}"
        mesh.spawn("spare", ["stage", "--model", str(tiny_model), "--port", "0", "--registry", mesh.registry_url,
                             "--memory-gb", budget], stage_env(None))
        assert len(wait_for_chains(router.address, 2, timeout=30)) == 2
    finally:
        mesh.stop()


def test_up_with_int8_weights_plans_the_asked_stages_and_serves(tiny_model, tmp_path):
    """Stages and scheduler agree on int8 sizes: the budget for 2 stages still yields 2-stage chains."""
    mesh, router = start_local_mesh(str(tiny_model), stages=2, router_port=0, registry="local",
                                    quantize="int8-weight-only", log_dir=tmp_path)
    try:
        chains = wait_for_chains(router.address, 1, timeout=60)
        assert [len(c.stages) for c in chains] == [2]
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            ids = [t for r in stub.Generate(router_pb2.GenerateRequest(token_ids=[5, 6], max_new_tokens=8), timeout=30)
                   for t in r.token_ids]
            assert 1 <= len(ids) <= 8
            held = 0
            for stage in chains[0].stages:
                with grpc.insecure_channel(stage.address) as stage_channel:
                    held += stage_pb2_grpc.StageStub(stage_channel).Info(stage_pb2.InfoRequest(),
                                                                         timeout=5).weight_bytes
        assert held < 0.45 * ModelFootprint.from_model_dir(tiny_model).total_bytes  # int8, not float32
    finally:
        mesh.stop()


def test_a_kv_pool_larger_than_the_hosts_memory_is_refused_in_one_line(tiny_model):
    """More --kv-cache-gb than the host has free: the stage exits 2 naming the flag, before serving (a pool
    the kernel lets it reserve but cannot back would be an out-of-memory kill once sessions fill it)."""
    too_much = 1.5 * psutil.virtual_memory().available / 2**30
    proc = subprocess.run([sys.executable, "-m", "stagemesh.cli", "stage", "--model", str(tiny_model),
                           "--layers", "0:8", "--port", "0", "--kv-cache-gb", f"{too_much:.1f}"],
                          capture_output=True, text=True, timeout=120, env=stage_env(1))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--kv-cache-gb" in proc.stderr and "available" in proc.stderr
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, proc.stderr[-3000:]
    assert "stage ready" not in proc.stdout


def imported(code: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """What `python -X importtime -c code` printed, and the modules it imported, in order."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    modules = [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    return out.stdout.strip(), modules


def test_a_service_process_sets_grpcs_transport_before_grpc_loads():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    printed, modules = imported("import os, stagemesh.cli; print(os.environ['GRPC_EXPERIMENTS'])", env)
    assert printed == GRPC_TRANSPORT_EXPERIMENTS
    assert modules.index("stagemesh.grpc_transport") < modules.index("grpc")  # grpc reads it when it loads


def test_a_library_user_importing_stagemesh_keeps_grpcs_defaults():
    """Importing stagemesh's stubs or client changes nothing in the user's process (issue 47)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", "HF_HUB_OFFLINE")}
    printed, _ = imported("import os, stagemesh, stagemesh.v1.router_pb2_grpc, stagemesh.tiny_model; "
                          "print(os.environ.get('GRPC_EXPERIMENTS'), os.environ.get('HF_HUB_OFFLINE'))", env)
    assert printed == "None None"


def test_a_users_own_grpc_experiments_are_kept():
    env = {**os.environ, "GRPC_EXPERIMENTS": "-event_engine_dns"}
    printed, _ = imported("import os, stagemesh.cli; print(os.environ['GRPC_EXPERIMENTS'])", env)
    assert printed == "-event_engine_dns"
