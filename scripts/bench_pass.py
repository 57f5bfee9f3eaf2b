"""One stage's decode pass, in process: milliseconds per pass of B sessions' decode steps (medians).

    python scripts/bench_pass.py                          # the tiny model, whole, B = 1, 8, 32, 64
    python scripts/bench_pass.py --code /tmp/old-tree     # the same with another checkout's stage code
    python scripts/bench_pass.py --medium --sizes 1,32
    python scripts/bench_pass.py --attention kernel,gather   # both decode attentions, passes alternated
    python scripts/bench_pass.py --medium --pack --threads 2   # Linear weights packed, as a stage holds them

No gRPC, no router: the model's forward pass alone, with each session holding `--context` positions
(prompts of different lengths around it, so the batch mixes lengths), one thread. Works with the
stage code before the paged pool (a whole cache per session) and after it (KVPool.grow). --attention names
the decode attentions to time side by side (kernel: the paged attention kernel, gather: SDPA over gathered K/V;
trees before the kernel have only the gather).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local checkpoint (default: models/tiny-llama)")
    p.add_argument("--medium", action="store_true", help="models/llama-270m")
    p.add_argument("--code", type=Path, default=ROOT, help="the checkout whose stage_server to time")
    p.add_argument("--sizes", default="1,8,32,64")
    p.add_argument("--context", type=int, default=200, help="mean positions each session holds")
    p.add_argument("--passes", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pack", action="store_true", help="pack the Linear weights as a CPU float32 stage does "
                   "(stage_server/packed_weights.py; default: torch's layout, as trees before it have)")
    p.add_argument("--attention", default="", help="kernel,gather: time each, passes alternated (default: the tree's)")
    args = p.parse_args()
    sys.path.insert(0, str(args.code.resolve()))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from stage_server.kv_pool import KVPool
    from stage_server.loader import load_stage
    from stage_server.model import StepSlice

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(ROOT / "models" / ("llama-270m" if args.medium else "tiny-llama"))
    model = load_stage(model_dir, 0, None)
    if args.pack:
        from stage_server import packed_weights

        packed_weights.pack(model)
    a = model.args
    variants = {"": getattr(model, "decode_attention", None)}
    if args.attention:
        from stage_server import paged_attention

        kinds = {"kernel": paged_attention.load(), "gather": None}
        variants = {name: kinds[name] for name in args.attention.split(",")}
    out = {}
    for size in (int(s) for s in args.sizes.split(",")):
        pool = KVPool(8 << 30, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype)
        lengths = [max(2, args.context + (i * 37) % 64 - 32) for i in range(size)]
        caches = [pool.allocate(n + args.passes + 8) for n in lengths]
        with torch.inference_mode():
            for c, n in zip(caches, lengths, strict=True):  # prefill each session alone
                if hasattr(pool, "grow"):
                    pool.grow(c, n)
                model(torch.randint(4, a.vocab_size, (n,)), [StepSlice(c, 0, 0, n)])
            times = {name: [] for name in variants}
            for _ in range(args.passes):
                for name, attention in variants.items():
                    if name:
                        model.decode_attention = attention
                    steps = []
                    for i, c in enumerate(caches):
                        if hasattr(pool, "grow"):
                            pool.grow(c, c.length + 1)
                        steps.append(StepSlice(c, i, c.length, 1))
                    t = time.perf_counter()
                    model(torch.randint(4, a.vocab_size, (size,)), steps)
                    times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            ms = out[f"{size}{'/' + name if name else ''}"] = statistics.median(ts[3:]) * 1000
            print(f"B={size:3d}{' ' + name if name else ''}: {ms:7.2f} ms per decode pass ({ms / size:.3f} ms per "
                  "session)", flush=True)
    print(json.dumps({"code": str(args.code), "model": model_dir, "context": args.context, "ms_per_pass": out}))


if __name__ == "__main__":
    main()
