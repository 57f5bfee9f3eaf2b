"""Peak RSS of a stage process holding the whole model vs. half of it: a stage reads only its slice.

    python scripts/measure_memory.py [--model DIR]   (default: makes a ~270M random Llama in models/)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stagemesh.launcher import start_local_mesh  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc  # noqa: E402

# A 4096-token context so that the benchmarks can time a 2048-token prompt on it.
MEDIUM = dict(layers=16, hidden=1024, heads=16, kv_heads=16, intermediate=2816, vocab=32000, max_position=4096)


def ensure_medium_model(path: Path) -> Path:
    """Makes the ~270M random Llama at path unless it is there (a copy with a shorter context is remade)."""
    config = path / "config.json"
    if not config.exists() or json.loads(config.read_text())["max_position_embeddings"] != MEDIUM["max_position"]:
        from stagemesh.tiny_model import make_tiny_model

        make_tiny_model(path, "llama", **MEDIUM, seed=0)
    return path


def chain_memory(model: str, stages: int, log_dir: Path) -> list[stage_pb2.StageInfo]:
    """Starts a chain, generates a few tokens so every weight has been read, and asks each stage."""
    mesh, router = start_local_mesh(model, stages=stages, router_port=0, log_dir=log_dir,
                                    extra_stage_args=["--kv-cache-gb", "0.1"])
    try:
        with grpc.insecure_channel(router.address) as channel:
            request = router_pb2.GenerateRequest(prompt="Once upon a time", max_new_tokens=8)
            list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
        infos = []
        for proc in mesh.processes[:-1]:
            with grpc.insecure_channel(proc.address) as channel:
                infos.append(stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10))
        return infos
    finally:
        mesh.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    a = p.parse_args()
    model = a.model or str(ensure_medium_model(Path("models/llama-270m")))
    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(model).num_hidden_layers
    log_dir = Path("bench-out/logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    infos = chain_memory(model, 1, log_dir) + chain_memory(model, 2, log_dir)
    whole = infos[0].peak_rss_bytes
    print(f"model {model}, {n} layers, after generating 8 tokens")
    print(f"{'layers':<8} {'weights MiB':>12} {'peak RSS MiB':>13} {'RSS vs whole':>13}")
    for info in infos:
        print(f"{info.layer_start}:{info.layer_end:<6} {info.weight_bytes / 2**20:12.0f} "
              f"{info.peak_rss_bytes / 2**20:13.0f} {info.peak_rss_bytes / whole:13.2f}")


if __name__ == "__main__":
    main()
