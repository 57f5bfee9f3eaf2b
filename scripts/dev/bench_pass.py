"""One stage's decode pass, in process: milliseconds per pass of B sessions' decode steps (medians).

    python scripts/dev/bench_pass.py                          # the tiny model, whole, B = 1, 8, 32, 64
    python scripts/dev/bench_pass.py --code /tmp/old-tree     # the same with another checkout's stage code
    python scripts/dev/bench_pass.py --medium --sizes 1,32
    python scripts/dev/bench_pass.py --attention kernel,gather   # both decode attentions, passes alternated
    python scripts/dev/bench_pass.py --medium --pack --threads 2   # Linear weights packed, as a stage holds them
    python scripts/dev/bench_pass.py --weights torch,panels,packed --sizes 1   # weight layouts side by side
    python scripts/dev/bench_pass.py --weights packed,layers --attention kernel   # a layer per call against op by op

No gRPC, no router: the model's forward pass alone, with each session holding `--context` positions
(prompts of different lengths around it, so the batch mixes lengths), one thread. Works with the
stage code before the paged pool (a whole cache per session) and after it (KVPool.grow). --attention names
the decode attentions to time side by side (kernel: the paged attention kernel, gather: SDPA over gathered K/V;
trees before the kernel have only the gather). --weights names weight layouts to time side by side, a copy of
the model each, passes alternated: torch (as loaded), panels (packed Linears, each RMSNorm apart), packed (as a
CPU float32 stage holds them: panels, each RMSNorm inside the Linear after it), layers (packed, and each layer of a
decode pass in one call, as a CPU float32 stage runs it by default: stage_server/cpu/decode_layers.py; it needs the
attention kernel, --attention kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
                   "(stage_server/cpu/packed_weights.py; default: torch's layout, as trees before it have)")
    p.add_argument("--attention", default="", help="kernel,gather: time each, passes alternated (default: the tree's)")
    p.add_argument("--weights", default="", help="torch,panels,packed,layers: time each layout, passes alternated "
                   "(default: --pack's)")
    args = p.parse_args()
    sys.path.insert(0, str(args.code.resolve()))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from stagemesh.stage_server.engine.kv_pool import KVPool
    from stagemesh.stage_server.engine.loader import load_stage
    from stagemesh.stage_server.engine.model import StepSlice

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(ROOT / "models" / ("llama-270m" if args.medium else "tiny-llama"))
    layouts = args.weights.split(",") if args.weights else ["packed" if args.pack else ""]
    models = {layout: load_stage(model_dir, 0, None) for layout in layouts}
    for layout, model in models.items():
        if layout in ("panels", "packed", "layers"):
            from stagemesh.stage_server.cpu import packed_weights

            if why := packed_weights.available(model):  # builds or loads the kernels
                raise SystemExit(f"no packed weights here: {why}")
            if layout == "panels":
                packed_weights.replace_linears(model, packed_weights.PackedLinear)
            else:
                packed_weights.pack(model)
        if layout == "layers":
            from stagemesh.stage_server.cpu import decode_layers
            from stagemesh.stage_server.engine import paged_attention

            if args.attention != "kernel":  # the layer calls the kernel: the other arms must attend by it too
                raise SystemExit("--weights ...,layers needs --attention kernel")
            paged_attention.attach(model)
            if why := decode_layers.attach(model):
                raise SystemExit(f"no layer per call here: {why}")
    model = models[layouts[0]]
    a = model.args
    attentions = {"": getattr(model, "decode_attention", None)}
    if args.attention:
        from stagemesh.stage_server.engine import paged_attention

        kinds = {"kernel": paged_attention.load(), "gather": None}
        attentions = {name: kinds[name] for name in args.attention.split(",")}
    variants = [(layout, name) for layout in layouts for name in attentions]
    out = {}
    for size in (int(s) for s in args.sizes.split(",")):
        lengths = [max(2, args.context + (i * 37) % 64 - 32) for i in range(size)]
        pools, caches = {}, {}
        with torch.inference_mode():
            for layout, model in models.items():  # each copy prefills the same sessions alone
                pool = pools[layout] = KVPool(8 << 30, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype)
                caches[layout] = [pool.allocate(n + args.passes * len(attentions) + 8) for n in lengths]
                for c, n in zip(caches[layout], lengths, strict=True):
                    if hasattr(pool, "grow"):
                        pool.grow(c, n)
                    model(torch.randint(4, a.vocab_size, (n,)), [StepSlice(c, 0, 0, n)])
            times = {"/".join(filter(None, v)): [] for v in variants}
            for _ in range(args.passes):
                for layout, name in variants:
                    model = models[layout]
                    if name:
                        model.decode_attention = attentions[name]
                    steps = []
                    for i, c in enumerate(caches[layout]):
                        if hasattr(pools[layout], "grow"):
                            pools[layout].grow(c, c.length + 1)
                        steps.append(StepSlice(c, i, c.length, 1))
                    t = time.perf_counter()
                    model(torch.randint(4, a.vocab_size, (size,)), steps)
                    times["/".join(filter(None, (layout, name)))].append(time.perf_counter() - t)
        for name, ts in times.items():
            ms = out[f"{size}{'/' + name if name else ''}"] = statistics.median(ts[3:]) * 1000
            print(f"B={size:3d}{' ' + name if name else ''}: {ms:7.2f} ms per decode pass ({ms / size:.3f} ms per "
                  "session)", flush=True)
    print(json.dumps({"code": str(args.code), "model": model_dir, "context": args.context, "ms_per_pass": out}))


if __name__ == "__main__":
    main()
