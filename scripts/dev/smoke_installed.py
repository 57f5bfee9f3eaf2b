"""The package as a user installs it: run from outside the checkout with the wheel installed (scripts/dev/check_wheel.sh
does), a 2-stage mesh of `stagemesh` processes streams tokens, every stage with stagemesh's CPU kernels loaded
(asserted from Stage/Info, which says what each stage computes with). Exits 0 when all holds."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import grpc

import stagemesh
from stagemesh.launcher import start_local_mesh, wait_for_chains
from stagemesh.tiny_model import make_tiny_model
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc


def main() -> None:
    where = Path(stagemesh.__file__).resolve()
    if "site-packages" not in where.parts:
        sys.exit(f"stagemesh was imported from {where}, not from an installed wheel: run this outside the checkout")
    with tempfile.TemporaryDirectory(prefix="stagemesh-smoke-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama", "llama", layers=4, seed=1)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        mesh, router = start_local_mesh(str(model), stages=2, router_port=0, log_dir=logs)
        try:
            wait_for_chains(router.address, 1)
            with grpc.insecure_channel(router.address) as channel:
                ids = [t for r in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
                    prompt="Once upon a time", max_new_tokens=8), timeout=120) for t in r.token_ids]
            assert len(ids) == 8, ids
            stages = [p for p in mesh.processes if p.name.startswith("stage")]
            for proc in stages:
                with grpc.insecure_channel(proc.address) as channel:
                    info = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)
                assert info.attention_kernel == "cpu" and info.packed_weights, (proc.name, info.attention_kernel)
            print(f"stagemesh {stagemesh.__version__} from {where.parent}: {len(stages)} stages with the CPU kernels "
                  f"loaded streamed {len(ids)} tokens")
        finally:
            mesh.stop()


if __name__ == "__main__":
    main()
