"""One stage's Linear weights multiplied by each way a CPU stage can hold them, side by side in one process:
milliseconds per pass of M rows over every Linear of `--layers` decoder layers (medians).

    python scripts/dev/bench_linear.py                       # the ~270M model's shapes, 8 layers, 1 thread
    python scripts/dev/bench_linear.py --threads 2 --rows 1,2,4,8,16,32,256

Arms: torch's F.linear over the weight laid out column-major (what a stage with --no-packed-weights holds:
MKL), oneDNN's matmul over a copy reordered into its blocked layout (what inductor's CPU freezing uses), and
stagemesh::packed_linear over panels (what a stage holds by default, stage_server/cpu/packed_weights.py). Each
arm's outputs are checked against float64 before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="1,2,4,8,16,32,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    from stagemesh.stage_server.cpu import cpu_kernels, packed_weights

    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        sys.exit("the CPU kernels could not be built here: nothing to compare")
    h, i = args.hidden, args.intermediate
    shapes = [(3 * h, h), (h, h), (2 * i, h), (h, i)]  # fused q/k/v, o, fused gate/up, down (no GQA)
    torch.manual_seed(0)
    plain = {s: torch.randn(*s) * 0.02 for s in shapes}
    arms = {
        "MKL (column-major)": {s: w.t().contiguous().t() for s, w in plain.items()},
        "oneDNN (reordered)": {s: torch.ops.mkldnn._reorder_linear_weight(w, None) for s, w in plain.items()},
        "stagemesh (panels)": {s: packed_weights.panels_of(w) for s, w in plain.items()},
    }
    calls = {
        "MKL (column-major)": lambda w, x, s: F.linear(x, w),
        "oneDNN (reordered)": lambda w, x, s: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "stagemesh (panels)": lambda w, x, s: torch.ops.stagemesh.packed_linear(x, w, None, s[0]),
    }
    for name, held in arms.items():
        for s in shapes:
            x = torch.randn(3, s[1])
            ref = F.linear(x.double(), plain[s].double())
            err = (calls[name](held[s], x, s).double() - ref).abs().max().item()
            assert err < 1e-4, f"{name} {s}: {err}"
    weight_mb = args.layers * sum(w.nbytes for w in plain.values()) / 1e6
    print(f"{args.layers} layers' Linears ({weight_mb:.0f} MB of float32 weights), {args.threads} thread(s): "
          f"ms per pass of M rows, medians of {args.repeats}")
    print(f"{'M':>5}  " + "  ".join(f"{n:>19}" for n in arms) + "  MKL / stagemesh")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {s: torch.randn(m, s[1]) for s in shapes}
            times = {n: [] for n in arms}
            for _ in range(args.repeats):
                for name, held in arms.items():  # the arms in turns: drift hits them alike
                    t = time.perf_counter()
                    for _ in range(args.layers):
                        for s in shapes:
                            calls[name](held[s], xs[s], s)
                    times[name].append((time.perf_counter() - t) * 1e3)
            med = {n: statistics.median(t) for n, t in times.items()}
            print(f"{m:>5}  " + "  ".join(f"{med[n]:>19.1f}" for n in arms)
                  + f"  {med['MKL (column-major)'] / med['stagemesh (panels)']:>15.2f}x", flush=True)


if __name__ == "__main__":
    main()
