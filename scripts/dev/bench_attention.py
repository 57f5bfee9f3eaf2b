"""The decode attention kernel alone (stagemesh::decode_attention), one thread, trees side by side.

    python scripts/dev/bench_attention.py                              # this checkout
    python scripts/dev/bench_attention.py --code /tmp/before --code .  # each tree's kernel, in turns
    python scripts/dev/bench_attention.py --rounds 3 --runs 21

Two cases per head shape (the tiny model's 8 query heads over 4 kv heads of 32; the ~270M model's 16 of 64):
"scattered", many sessions whose 16-position blocks lie shuffled through a pool larger than the caches, as a busy
stage's do (bound by memory: GB/s of K and V read), and "resident", the same work over a few blocks every session
shares, which stay in cache (bound by the kernel's arithmetic: ns per position and query head). Each tree runs in
its own process (two trees' kernels cannot load into one), in turns, --rounds times; medians, and each tree's
ratio to the first. No model, no pool class: tensors shaped as a stage's pool view.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"tiny": (8, 4, 32), "270m": (16, 16, 64)}  # query heads, kv heads, head size
BLOCK = 16


def pool_tensor(shape: tuple[int, ...]):
    """Random float32 K or V laid out as the tree's stages lay out their pool (on 2 MiB pages where it does)."""
    import torch

    try:
        from stagemesh.stage_server.cpu import huge_pages
    except ImportError:  # trees before huge pages
        return torch.randn(shape)
    return huge_pages.zeros(shape, torch.float32, True).normal_()


def worker(shapes: list[str], sessions: int, context: int, runs: int) -> dict[str, float]:
    """Times this tree's kernel (the checkout on sys.path) on each shape and case."""
    import torch

    from stagemesh.stage_server.engine import paged_attention

    kernel = paged_attention.load()
    if kernel is None:
        raise SystemExit("the decode attention kernel could not be built here")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {}
    for name in shapes:
        H, kvH, D = SHAPES[name]
        nb = -(-context // BLOCK)
        ends = torch.tensor([context - (b % 7) * (context // 30) for b in range(sessions)])
        q = torch.randn(sessions, H, D)
        for case in ("scattered", "resident"):
            if case == "scattered":
                blocks = list(range(1, sessions * nb + 1))
                random.Random(0).shuffle(blocks)
                table = torch.tensor([blocks[b * nb:(b + 1) * nb] for b in range(sessions)])
                slots = (sessions * nb + 1) * BLOCK
            else:
                table = torch.tensor([list(range(1, nb + 1))] * sessions)
                slots = (nb + 1) * BLOCK
            k, v = pool_tensor((slots, kvH, D)), pool_tensor((slots, kvH, D))
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                kernel(q, k, v, table, ends, BLOCK, 0, D**-0.5)
                times.append(time.perf_counter() - t)
            s = statistics.median(times)
            positions = int(ends.sum())
            out[f"{name} {case} ms"] = s * 1e3
            out[f"{name} {case} GB/s"] = 2 * positions * kvH * D * 4 / s / 1e9
            out[f"{name} {case} ns per position-head"] = s / (positions * H) * 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", type=Path, action="append", help="a checkout whose kernel to time (repeatable)")
    p.add_argument("--shapes", default="tiny,270m")
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--context", type=int, default=400, help="positions the longest session holds")
    p.add_argument("--runs", type=int, default=15, help="calls timed per case (median)")
    p.add_argument("--rounds", type=int, default=1, help="turns of every tree")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shapes = args.shapes.split(",")
    if args.worker:
        print(json.dumps(worker(shapes, args.sessions, args.context, args.runs)))
        return
    trees = [c.resolve() for c in args.code or [ROOT]]
    results: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            proc = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], cwd=tree, capture_output=True,
                                  text=True, env={**os.environ, "PYTHONPATH": str(tree)})
            if proc.returncode != 0:
                raise SystemExit(f"{tree}: {proc.stderr.strip()[-2000:]}")
            results[tree].append(json.loads(proc.stdout.splitlines()[-1]))
    medians = {str(t): {key: statistics.median(r[key] for r in runs) for key in runs[0]} for t, runs in results.items()}
    first = medians[str(trees[0])]
    print(f"decode attention alone, one thread, {args.sessions} sessions of up to {args.context} positions, "
          f"medians of {args.runs} calls x {args.rounds} round(s)")
    for tree, figures in medians.items():
        print(f"  {tree}")
        for key, value in figures.items():
            print(f"    {key:40s} {value:9.3f}  {value / first[key]:.2f}x")
    print(json.dumps({"sessions": args.sessions, "context": args.context, "medians": medians}))


if __name__ == "__main__":
    main()
