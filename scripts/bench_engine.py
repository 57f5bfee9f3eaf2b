"""A stage's engine in one process, against the memory floor: random weights in a model's shape (no checkpoint
to write or read, so an 8B shape is ready in seconds), the stage's own model, KV pool, attention kernel and graphs.

    python scripts/bench_engine.py --shape 1b --shape 8b           # on a GPU (scripts/gpu_check.sh runs it)
    python scripts/bench_engine.py --shape tiny --device cpu --quick  # what a CPU can run (the suite's smoke test)

For each shape it reports, as medians:
- the memory bandwidth (a device-to-device copy) and the batch-1 floor it sets: the weights' bytes / bandwidth;
- one session's decode step (whole model in one stage), ms, and its share of the floor;
- a decode pass of --sessions sessions x --context positions: ms against (weights + their K/V bytes) / bandwidth;
- a --prompt-token prompt's first token: one pass, and in chunks of --chunk tokens (the chunked ones each attend
  over the chunks before them, as a stage runs them), the ratio of the two;
- the CUDA graphs: buckets captured, capture seconds and memory, and passes that ran eager (should be none).
With --json FILE the figures are written there too.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stagemesh import metrics  # noqa: E402
from stagemesh.checkpoint import ModelArgs  # noqa: E402
from stagemesh.stage_server.engine import fused_ops, paged_attention  # noqa: E402
from stagemesh.stage_server.engine.kv_pool import KVPool  # noqa: E402
from stagemesh.stage_server.engine.model import StageModel, StepSlice  # noqa: E402
from stagemesh.stage_server.gpu.cuda_graphs import GraphedPasses  # noqa: E402

SHAPES = {
    # TinyLlama-1.1B
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192, rope_theta=10000.0),
    # Llama-3-8B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # stagemesh's tiny Llama (tests, CPU smoke runs)
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1000, max_position_embeddings=2048, rope_theta=10000.0),
}


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> StageModel:
    """The whole model as one stage, weights drawn at random on the device (scaled so activations stay sane)."""
    config = {"model_type": "llama", "rms_norm_eps": 1e-5, **SHAPES[shape]}
    args = ModelArgs.from_config(config)
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
    with torch.device(device):
        model = StageModel(args, 0, args.num_layers, inv_freq, 1.0).to(dtype)
    model.inv_freq = inv_freq.to(device)  # float32 on the device, as the loader leaves it (.to(dtype) narrowed it)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model.eval()


def bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 10."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[2:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of fn() over repeats (after one untimed call), each synchronized."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill(model: StageModel, pool: KVPool, caches, lengths: list[int]) -> None:
    """Fills each session to its length (passes of at most 2048 tokens, as K/V to attend over)."""
    for cache, n in zip(caches, lengths, strict=True):
        done = 0
        while done < n:
            step = min(2048, n - done)
            pool.grow(cache, done + step)
            model(model.scratch_inputs(step), [StepSlice(cache, 0, done, step)])
            done += step


def decode_pass(model: StageModel, pool: KVPool, caches) -> None:
    """One decode step of every session, then each rewinds it (the context stays the same pass after pass)."""
    steps = []
    for i, cache in enumerate(caches):
        pool.grow(cache, cache.length + 1)
        steps.append(StepSlice(cache, i, cache.length, 1))
    model(model.scratch_inputs(len(steps)), steps)
    for cache in caches:
        cache.length -= 1


def measure(shape: str, args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = random_model(shape, device, dtype)
    a = model.args
    weight_bytes = sum(p.nbytes for p in model.parameters())
    paged_attention.attach(model)
    if args.fused_layers:
        fused_ops.attach(model)  # a CUDA stage's default (--fused-layers)
    out: dict = {"shape": shape, "device": str(device), "dtype": args.dtype, "weights_GiB": weight_bytes / 2**30,
                 "attention": "triton" if model.ragged_attention is not None else
                 ("cpu kernel" if model.decode_attention is not None else "gathered SDPA"),
                 "fused_ops": model.fused_ops is not None}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    bw = bandwidth(device)
    out["bandwidth_GBps"] = bw / 1e9
    out["floor_ms"] = weight_bytes / bw * 1000
    kv_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * dtype.itemsize
    context = min(args.context, a.max_position - 1)
    pool_bytes = kv_per_token * (args.sessions * (context + 32) + args.prompt_tokens + 64) * 5 // 4
    pool = KVPool(pool_bytes, a.num_layers, a.num_kv_heads, a.head_dim, dtype, device, block_size=16, huge=False)
    graphs = None
    if device.type == "cuda" and model.ragged_attention is not None and not args.eager:
        t = time.perf_counter()
        graphs = GraphedPasses(model, pool, max_tokens=args.max_batch_tokens, max_len=a.max_position)
        cap = graphs.capture_all()
        model.pass_graphs = graphs
        out["graphs"] = {"captured": cap.graphs, "seconds": cap.seconds, "MiB": cap.bytes / 2**20,
                         "buckets": cap.buckets, "failed": cap.failed, "wall_s": time.perf_counter() - t}
    eager_before = sum(s.value for m in metrics.EAGER_PASSES.collect() for s in m.samples
                       if s.name.endswith("_total"))
    with torch.inference_mode():
        one = [pool.allocate(a.max_position)]
        prefill(model, pool, one, [16])
        out["single_stream_ms"] = timed(device, lambda: decode_pass(model, pool, one), args.repeats) * 1000
        out["single_stream_of_floor"] = out["floor_ms"] / out["single_stream_ms"]
        pool.release(one[0])
        many = [pool.allocate(a.max_position) for _ in range(args.sessions)]
        prefill(model, pool, many, [context] * args.sessions)
        kv_bytes = args.sessions * context * kv_per_token
        out["batch"] = {"sessions": args.sessions, "context": context,
                        "ms": timed(device, lambda: decode_pass(model, pool, many), args.repeats) * 1000,
                        "floor_ms": (weight_bytes + kv_bytes) / bw * 1000}
        out["batch"]["of_floor"] = out["batch"]["floor_ms"] / out["batch"]["ms"]
        for cache in many:
            pool.release(cache)
        n, chunk = min(args.prompt_tokens, a.max_position - 1), args.chunk

        def first_token(size: int) -> None:
            cache = pool.allocate(n + 1)
            try:
                for done in range(0, n, size):
                    step = min(size, n - done)
                    pool.grow(cache, done + step)
                    model(model.scratch_inputs(step), [StepSlice(cache, 0, done, step)])
            finally:
                pool.release(cache)

        whole = timed(device, lambda: first_token(n), args.repeats) * 1000
        chunked = timed(device, lambda: first_token(chunk), args.repeats) * 1000
        out["prompt"] = {"tokens": n, "chunk": chunk, "whole_ms": whole, "chunked_ms": chunked,
                         "chunked_over_whole": chunked / whole}
    out["eager_passes"] = sum(s.value for m in metrics.EAGER_PASSES.collect() for s in m.samples
                              if s.name.endswith("_total")) - eager_before
    return out


def report(r: dict) -> None:
    print(f"\n== {r['shape']} on {r.get('gpu', r['device'])}, {r['dtype']}, {r['weights_GiB']:.2f} GiB of weights, "
          f"attention: {r['attention']}, a layer's small ops {'fused' if r['fused_ops'] else 'one by one'}")
    print(f"memory bandwidth {r['bandwidth_GBps']:.0f} GB/s: batch-1 floor {r['floor_ms']:.3f} ms/token")
    print(f"one session's decode step: {r['single_stream_ms']:.3f} ms ({r['single_stream_of_floor']:.0%} of the floor)")
    b = r["batch"]
    print(f"decode pass of {b['sessions']} sessions x {b['context']} positions: {b['ms']:.2f} ms against a floor of "
          f"{b['floor_ms']:.2f} (weights + K/V; {b['ms'] / b['floor_ms']:.2f}x)")
    p = r["prompt"]
    print(f"a {p['tokens']}-token prompt's first token: {p['whole_ms']:.1f} ms in one pass, {p['chunked_ms']:.1f} ms "
          f"in chunks of {p['chunk']} ({p['chunked_over_whole']:.2f}x)")
    if "graphs" in r:
        g = r["graphs"]
        print(f"CUDA graphs: {g['captured']} captured in {g['seconds']:.1f}s, {g['MiB']:.0f} MiB"
              + (f"; capture failed: {g['failed']}" if g["failed"] else ""))
        for line in g["buckets"]:
            print(f"  {line}")
    print(f"passes that ran eager: {r['eager_passes']:.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: 1b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--fused-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="a layer's small ops in one Triton kernel each on CUDA, as a stage runs by default")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 sessions x 64 positions, a 128-token "
                                                        "prompt in chunks of 32, 3 repeats")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.sessions, args.context, args.prompt_tokens, args.chunk, args.repeats = 4, 64, 128, 32, 3
    results = []
    for shape in args.shape or ["1b"]:
        results.append(measure(shape, args))
        report(results[-1])
        gc.collect()  # the last shape's model and its graphs refer to each other
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the last shape's weights and pool, gone with measure()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
