"""Issue 15's whole-step compile in process: stage_server/engine/decode_graph.py's decode pass (every layer, K/V writes
into the paged pool and attention over it) compiled with variants of torch.compile's options, timed against the
eager pass. The stage's --compile uses c_keept (stage_server/engine/compiled.py).

    python scripts/dev/bench_step_compile.py [--model DIR] [--end 4] [--sizes 1] [--variants eager,c,c_keept,c_cpp]
    python scripts/dev/bench_step_compile.py --device cuda --dtype bfloat16 --model DIR --end 11 --sizes 1,32,64 \
        --variants eager,graphs          # issue 15's CUDA graphs against eager (scripts/gpu_check.sh)

Variants (run alternately, medians): eager (StageModel.forward), stage (StageModel.forward with --compile's
CompiledDecode: c_keept plus the block tables and positions made per pass), c (torch.compile, default guards), c_skipmod
(guard_filter_fn=skip_guard_on_all_nn_modules_unsafe), c_keept (keep_tensor_guards_unsafe), a "cpp" in the name
adds cpp_wrapper, a "static" static shapes (a graph per batch size and per power-of-two bucket of key blocks,
NULL_BLOCK padding) instead of dynamic batch size and key length; graphs is a CUDA stage's default
(stage_server/gpu/cuda_graphs.py: the pass replayed from a CUDA graph per padded bucket, through
StageModel.forward, with the Triton attention kernel; on CUDA only). On CUDA every pass is timed to its end
(synchronized).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.compiler as tc  # noqa: E402

from stagemesh.stage_server.engine import paged_attention  # noqa: E402
from stagemesh.stage_server.engine.compiled import CompiledDecode  # noqa: E402
from stagemesh.stage_server.engine.decode_graph import decode_pass_fn, key_blocks  # noqa: E402
from stagemesh.stage_server.engine.kv_pool import KVPool  # noqa: E402
from stagemesh.stage_server.engine.loader import load_stage  # noqa: E402
from stagemesh.stage_server.engine.model import StageModel, StepSlice  # noqa: E402
from stagemesh.stage_server.gpu.cuda_graphs import GraphedPasses  # noqa: E402


def compiled_variant(fn, name: str):
    opts: dict = {}
    if "skipmod" in name:
        opts["guard_filter_fn"] = tc.skip_guard_on_all_nn_modules_unsafe
    if "keept" in name:
        opts["guard_filter_fn"] = tc.keep_tensor_guards_unsafe
    if "cpp" in name:
        opts["cpp_wrapper"] = True
    # its own code object: its own cache
    fresh = types.FunctionType(fn.__code__.replace(co_name=f"step_{name}"), fn.__globals__, closure=fn.__closure__)
    return torch.compile(fresh, dynamic="static" not in name, fullgraph=True, options=opts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--end", type=int, default=4, help="the stage's layers: 0:end")
    p.add_argument("--sizes", default="1")
    p.add_argument("--passes", type=int, default=200)
    p.add_argument("--variants", default="eager,stage,c,c_keept,c_cpp_keept")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_stage(args.model, 0, args.end, dtype=getattr(torch, args.dtype), device=args.device)
    for B in (int(s) for s in args.sizes.split(",")):
        run_size(model, B, args)


def run_size(model: StageModel, B: int, args: argparse.Namespace) -> None:
    a = model.args
    dev = model.device
    cuda = dev.type == "cuda"
    pool = KVPool(1 << 30, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype, dev)
    fn = decode_pass_fn(model, pool.block_size)
    stage = CompiledDecode(model)  # the stage's own --compile path, through StageModel.forward
    graphed = None
    if "graphs" in args.variants.split(","):
        t = time.perf_counter()
        paged_attention.attach(model)  # the graphs' attention: the Triton kernel (CUDA)
        graphed = GraphedPasses(model, pool, max_tokens=B, max_len=4096, capture=cuda)
        captured = graphed.capture_all()
        print(f"graphs: {captured.graphs} captured in {time.perf_counter() - t:.2f}s", flush=True)
    by_name = {"eager": None, "stage": stage, "graphs": graphed}
    variants = {v: v if v in by_name else compiled_variant(fn, v) for v in args.variants.split(",")}
    caches = [pool.allocate(args.passes * len(variants) + 400) for _ in range(B)]

    def inputs(n: int) -> torch.Tensor:
        if model.is_first:
            return torch.randint(4, a.vocab_size, (n,), device=dev)
        return torch.randn(n, a.hidden_size, device=dev, dtype=model.dtype)

    with torch.inference_mode():
        for i, c in enumerate(caches):
            n = 100 + 7 * i
            pool.grow(c, n)
            model(inputs(n), [StepSlice(c, 0, 0, n)])
        cos, sin = model.rope(4096, model.dtype)

        def one(f):
            steps = []
            for i, c in enumerate(caches):
                pool.grow(c, c.length + 1)
                steps.append(StepSlice(c, i, c.length, 1))
            x = inputs(B)
            if isinstance(f, str):  # eager, the stage's compiled path or its CUDA graphs
                model.decode_graph = by_name[f] if f == "stage" else None
                model.pass_graphs = by_name[f] if f == "graphs" else None
                return model(x, steps)
            pos = torch.tensor([st.start for st in steps], device=dev)
            nb = key_blocks(steps)
            if "static" in f.__name__:  # static shapes: key blocks padded to a power of two (a graph per bucket)
                nb = 1 << (nb - 1).bit_length()
            table = torch.tensor([c.block_table(nb) for c in caches], device=dev)
            out = f(x, pos, table, cos, sin, pool.k, pool.v)
            for st in steps:
                st.cache.length = st.start + 1
            return out

        times: dict[str, list[float]] = {k: [] for k in variants}
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for k, f in variants.items():
            t = time.perf_counter()
            one(f)
            sync()
            print(f"{k}: first call {time.perf_counter() - t:.2f}s", flush=True)
        for _ in range(args.passes):
            for k, f in variants.items():
                sync()
                t = time.perf_counter()
                one(f)
                sync()
                times[k].append(time.perf_counter() - t)
    for k in variants:
        print(f"layers 0:{args.end} B={B} {k}: {statistics.median(times[k]) * 1000:.3f} ms per decode pass "
              f"({dev.type}, {args.dtype})", flush=True)


if __name__ == "__main__":
    main()
