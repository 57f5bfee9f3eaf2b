"""Speed levers next to their accuracy cost: dtype, int8 weights, hidden states on the wire.

    python scripts/bench_levers.py [--model DIR | --medium] [--tokens 512] [--decode 64] [--levers float32,int8 weights]

Accuracy (in one process, the same code the stages run): the float32 model's greedy continuation
of a prompt is the reference; each lever runs the same sequence teacher-forced and reports how many
of the next-token choices (top-1) agree with float32 and the largest logit difference. Speed: a
2-stage mesh (separate processes) decodes one stream with the lever on; tokens/s is the median of
runs, next to the float32 mesh's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.measure_memory import ensure_medium_model  # noqa: E402
from stagemesh import tensor_codec  # noqa: E402
from stagemesh.launcher import ensure_tiny_model, start_local_mesh  # noqa: E402
from stagemesh.stage_server.engine.kv_pool import KVPool  # noqa: E402
from stagemesh.stage_server.engine.loader import load_stage  # noqa: E402
from stagemesh.stage_server.engine.model import StepSlice  # noqa: E402
from stagemesh.stage_server.engine.quantize import quantize  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc  # noqa: E402

# name: (stage dtype, quantize, wire dtype between the two stages)
LEVERS = {
    "float32": ("float32", "none", ""),
    "bfloat16": ("bfloat16", "none", ""),
    "float16": ("float16", "none", ""),
    "int8 weights": ("float32", "int8", ""),
    "int8 weight-only": ("float32", "int8-weight-only", ""),
    "bf16 + int8 weights": ("bfloat16", "int8", ""),
    "wire bfloat16": ("float32", "none", "bfloat16"),
    "wire int8": ("float32", "none", "int8"),
}


def all_logits(model_dir: str, lever: str, ids: list[int]) -> torch.Tensor:
    """Logits after every position of ids [len, vocab], through two slices joined by the wire."""
    dtype, how, wire = LEVERS[lever]
    tdtype = getattr(torch, dtype)
    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    halves = [quantize(load_stage(model_dir, a, b, dtype=tdtype), how) for a, b in ((0, n // 2), (n // 2, n))]
    x = torch.tensor(ids)
    pools = [KVPool(1 << 30, len(m.layers), m.args.num_kv_heads, m.args.head_dim, tdtype) for m in halves]
    caches = [p.allocate(len(ids)) for p in pools]
    for p, c in zip(pools, caches, strict=True):
        p.grow(c, len(ids))  # the blocks of every position, taken up front
    hidden = halves[0](x, [StepSlice(caches[0], 0, 0, len(ids))])
    hidden = tensor_codec.decode(tensor_codec.encode_hidden(hidden, wire))
    # The last stage returns the last position's logits only; ask it for each position in turn.
    out = []
    for i in range(len(ids)):
        out.append(halves[1](hidden[i : i + 1], [StepSlice(caches[1], 0, i, 1)])[0])
    return torch.stack(out)


def greedy_reference(model_dir: str, prompt: list[int], tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    return out[0].tolist()


def mesh_decode_speed(model_dir: str, lever: str, decode: int, runs: int) -> float:
    dtype, how, wire = LEVERS[lever]
    mesh, router = start_local_mesh(model_dir, stages=2, router_port=0, dtype=dtype,
                                    quantize=how, extra_stage_args=["--kv-cache-gb", "1"],
                                    extra_router_args=["--wire-dtype", wire] if wire else [])
    try:
        speeds = []
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.GenerateRequest(token_ids=list(range(5, 37)), max_new_tokens=decode)
            for _ in range(runs + 1):  # the first run warms up
                first = last = None
                n = 0
                for response in stub.Generate(request, timeout=600):
                    last = time.perf_counter()
                    first = first or last
                    n += len(response.token_ids)
                speeds.append((n - 1) / (last - first))
        return statistics.median(speeds[1:])
    finally:
        mesh.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--medium", action="store_true", help="the ~270M Llama (made in models/ if absent)")
    p.add_argument("--tokens", type=int, default=512, help="greedy tokens compared for agreement")
    p.add_argument("--decode", type=int, default=64, help="tokens per speed run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--levers", default=",".join(LEVERS),
                   help=f"comma-separated, from: {', '.join(LEVERS)} (speeds are relative to the first)")
    a = p.parse_args()
    levers = a.levers.split(",")
    if unknown := set(levers) - set(LEVERS):
        p.error(f"unknown lever(s) {', '.join(sorted(unknown))}; choose from {', '.join(LEVERS)}")
    torch.set_num_threads(2)
    model = a.model or str(ensure_medium_model(Path("models/llama-270m")) if a.medium
                           else ensure_tiny_model(Path("models/tiny-llama")))
    prompt = list(range(5, 37))
    seq = greedy_reference(model, prompt, a.tokens)
    ref = all_logits(model, "float32", seq[:-1])
    positions = slice(len(prompt) - 1, len(seq) - 1)  # logits that chose each generated token
    print(f"model {model}; agreement over {a.tokens} greedy tokens (teacher-forced), speed: 2-stage mesh, "
          f"1 stream, median of {a.runs} runs of {a.decode} tokens")
    print(f"{'lever':<20} {'top-1 agree':>11} {'max |dlogit|':>13} {'wire B/token':>13} {'tokens/s':>9} {'vs f32':>7}")
    base = None
    for lever in levers:
        dtype, _, wire = LEVERS[lever]
        logits = ref if lever == "float32" else all_logits(model, lever, seq[:-1])
        agree = (logits[positions].argmax(-1) == ref[positions].argmax(-1)).float().mean().item()
        err = (logits[positions].float() - ref[positions]).abs().max().item()
        hidden = ref.new_zeros(1, load_stage(model, 0, 1).args.hidden_size)
        wire_bytes = len(tensor_codec.encode_hidden(hidden.to(getattr(torch, dtype)), wire).data)
        speed = mesh_decode_speed(model, lever, a.decode, a.runs)
        base = base or speed
        print(f"{lever:<20} {agree:>11.1%} {err:>13.4f} {wire_bytes:>13} {speed:>9.1f} {speed / base:>6.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
