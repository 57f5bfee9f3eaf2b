"""The per-token floor (issue 15), side by side in one run: what a decode step costs outside the math.

    python scripts/dev/bench_floor.py            # all parts, ~8 min on 2 cores (the ~270M model is made if absent)
    python scripts/dev/bench_floor.py --quick    # a smoke run: the wire, and the tiny chain without --compile (~1 min)
    python scripts/dev/bench_floor.py --no-medium --no-compile
    python scripts/dev/bench_floor.py --no-medium --also-with=--no-fused-layers   # the tiny chain with and without
    python scripts/dev/bench_floor.py --no-compile --code /tmp/before --code . --rounds 3   # two trees, in turns

1. The wire: each copy removed from the stage's side of a hop, timed alone, before and now, on a one-token
   hidden state at hidden 256 and 1024 and on a 256-token prefill chunk: encode (a message of its own, then
   CopyFrom into the response; now written into the response's field) and decode (the received bytes copied
   into a bytearray; now viewed as they are).
2. Tiny Llama (hidden 256, 8 layers), a 2-stage chain of 1-thread stage processes driven through the router's
   Generate stream (bench.py's start_local_mesh and mesh_decode), against transformers' generate() in one
   process on 1 thread: decode ms/token and the ratio; with --compile off and on (--compile: each stage's decode
   passes as one compiled graph, stage_server/engine/compiled.py; its compilation shows in the cold start); --also-with
   adds the chain once more with these stage flags (a side-by-side A/B).
3. A per-step breakdown of each stage of that chain (stage_server/engine/step_timing.py: the stage's own phase timers,
   read from Stage/Info before and after the decode runs): wire decode, batch assembly, model, sampling,
   encode; what the token costs beyond both stages' phases is gRPC, event loops, the router and the hops.
4. ~270M Llama: one- and two-thread memory-bandwidth ceilings (a float32 GEMV over a matrix the size of the
   weights: the time to stream the weights once), a 2-stage chain of 1-thread stages as a share of the
   one-thread ceiling, one stage with 2 threads as a share of the two-thread ceiling; with --medium-compile both
   again with --compile (its first compilation, with inductor's cache cold, takes minutes: the
   mesh waits up to bench.READY_TIMEOUT_S for it).

With --code (repeatable), each checkout runs its own bench_floor.py (cwd there: its stage and router processes run
its code), --rounds times in turns, and the medians of the runs are printed side by side, each as a ratio to the
first tree's: one run of a machine whose speed drifts by 5-10% between minutes cannot tell two trees apart.

Writes DIR/floor.json (with --code: DIR/<tree>-<round>/floor.json each). Speed is only measured here, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import bench  # noqa: E402  (its helpers: workers, workload, mesh calls)
from stagemesh.stage_server.engine.step_timing import PHASES  # noqa: E402

WIRE_SHAPES = ((1, 256), (1, 1024), (256, 1024))  # a decode step's hidden state at both sizes; a prefill chunk


# --------------------------------------------------------------------------------------------------
# 1. The wire


def per_call_us(fn, n: int, repeats: int = 9) -> float:
    """Median over repeats of the mean µs per call of fn over n calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def wire_row(tokens: int, hidden: int, calls: int) -> dict:
    """Each removed copy timed alone, as it was and as it is, on a [tokens, hidden] float32 hidden state:
    encode: a Tensor message of its own then CopyFrom into the relayed step, against writing into the step's
    field; decode: the received bytes copied into a bytearray and viewed, against viewed as they are."""
    import torch

    from stagemesh import tensor_codec
    from stagemesh.v1 import stage_pb2

    h = torch.randn(tokens, hidden)
    received = stage_pb2.ForwardRequest(session_id="0" * 32, start=7)
    tensor_codec.encode_hidden_into(received.hidden, h)
    received = stage_pb2.ForwardRequest.FromString(received.SerializeToString())  # as gRPC hands it over
    data = received.hidden.data

    def encode_before():
        stage_pb2.ForwardRequest(session_id="0" * 32).hidden.CopyFrom(tensor_codec.encode_hidden(h))

    def encode_now():
        tensor_codec.encode_hidden_into(stage_pb2.ForwardRequest(session_id="0" * 32).hidden, h)

    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).view(tokens, hidden),
                       tensor_codec.decode(received.hidden))
    return {
        "tokens": tokens, "hidden": hidden,
        "encode_before_us": per_call_us(encode_before, calls),
        "encode_after_us": per_call_us(encode_now, calls),
        "decode_before_us": per_call_us(lambda: torch.frombuffer(bytearray(data), dtype=torch.float32), calls),
        "decode_after_us": per_call_us(lambda: torch.frombuffer(data, dtype=torch.float32), calls),
        "whole_decode_us": per_call_us(lambda: tensor_codec.decode(received.hidden), calls),
    }


def wire_micro(n: int) -> list[dict]:
    return [wire_row(tokens, hidden, max(20, n // tokens)) for tokens, hidden in WIRE_SHAPES]


# --------------------------------------------------------------------------------------------------
# 2-4. Chains, transformers, ceilings


def stage_infos(mesh) -> dict[str, dict]:
    """Each stage process's step-phase totals (Stage/Info)."""
    import grpc

    from stagemesh.v1 import stage_pb2, stage_pb2_grpc

    out = {}
    for proc in mesh.processes:
        if proc.name.startswith("stage") and proc.popen.poll() is None:
            with grpc.insecure_channel(proc.address) as channel:
                info = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)
            out[f"{info.layer_start}:{info.layer_end}"] = {"phases": dict(info.decode_phase_seconds),
                                                            "steps": info.decode_steps, "load_s": info.load_s}
    return out


def breakdown(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, float]]:
    """µs per step in each phase, per stage, over what happened between the two readings."""
    out = {}
    for stage, a in after.items():
        b = before[stage]
        steps = max(1, a["steps"] - b["steps"])
        out[stage] = {p: (s - b["phases"].get(p, 0.0)) / steps * 1e6 for p, s in a["phases"].items()}
    return out


def run_chain(model: str, stages: int, threads: int, plan, w, log_dir: Path, extra: list[str]) -> dict:
    """A chain of stage processes behind a router: decode tok/s (median of plan.repeats) and each stage's
    per-step breakdown over those runs."""
    from stagemesh.launcher import start_local_mesh

    t0 = time.perf_counter()
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh, router = start_local_mesh(model, stages=stages, threads=threads, router_port=0, log_dir=log_dir,
                                    extra_stage_args=["--device", "cpu", "--kv-cache-gb", "0.5", *extra],
                                    ready_timeout_s=bench.READY_TIMEOUT_S)
    try:
        up_s = time.perf_counter() - t0
        result = bench.SystemResult(f"{stages} stage(s) x {threads} thread(s) {' '.join(extra)}".strip(), stages, 1)
        before = stage_infos(mesh)
        asyncio.run(bench.mesh_decode(router.address, w, plan, result))  # an 8-token warm-up, then the runs
        after = stage_infos(mesh)
    finally:
        bench.uninterrupted(mesh.stop)
    tok_s = statistics.median(result.decode_tok_s)
    return {"system": result.system, "tok_s": tok_s, "ms_per_token": 1000 / tok_s, "runs": result.decode_tok_s,
            "ids": result.decode_ids, "up_s": up_s, "cold_start_s": {k: v["load_s"] for k, v in after.items()},
            "breakdown_us": breakdown(before, after)}


def run_transformers(model: str, threads: int, plan, w, tmp: Path) -> dict:
    spec = {"model": model, "dtype": "float32", "threads": threads, "repeats": plan.repeats,
            "concurrency_repeats": 0, "decode_tokens": plan.decode_tokens, "levels": [],
            "workload": asdict(w)}
    r = bench.run_worker("transformers", spec, threads, tmp)
    tok_s = statistics.median(r["decode_tok_s"])
    return {"tok_s": tok_s, "ms_per_token": 1000 / tok_s, "runs": r["decode_tok_s"], "ids": r["decode_ids"]}


def ceiling(model: str, threads: int, runs: int, tmp: Path) -> dict:
    """Streaming the weights' bytes once (a float32 GEMV over a matrix of their size) on `threads` threads: the
    fastest of the runs, since a ceiling is what the machine can do, and a busy machine can only lower it."""
    _, weight_bytes = bench.weight_bytes_per_token(model, "float32")
    r = bench.run_worker("gemv", {"gib": weight_bytes / 2**30, "runs": runs, "threads": threads}, threads, tmp)
    bytes_per_s = r["matrix_bytes"] / min(r["seconds"])
    return {"threads": threads, "bytes_per_s": bytes_per_s, "median_bytes_per_s": r["bytes_per_s"],
            "weight_bytes": weight_bytes, "method": r.get("method"),
            "methods_bytes_per_s": r.get("methods_bytes_per_s"),
            "ms_per_token": weight_bytes / bytes_per_s * 1000, "tok_s": bytes_per_s / weight_bytes}


def disturbed(notes: dict[str, float], label: str, fn, *args):
    """fn(*args), noting the share of the CPUs other processes took meanwhile (bench.foreign_share)."""
    t, cpu = time.perf_counter(), bench.cpu_seconds()
    out = fn(*args)
    notes[label] = bench.foreign_share(cpu, time.perf_counter() - t)
    return out


def best_ceiling(*runs: dict) -> dict:
    return max(runs, key=lambda c: c["bytes_per_s"])


def small_plan(repeats: int, tokens: int):
    """Single-stream decode only (bench.Plan's workload, with two short streams for transformers' warm-up)."""
    return bench.Plan(stages=[2], replicas=[1], levels=[2], repeats=repeats, concurrency_repeats=0,
                      decode_tokens=tokens, ttft_lengths=(), prompt_range=(8, 16), output_range=(4, 8))


# --------------------------------------------------------------------------------------------------
# The report


def print_wire(rows: list[dict]) -> None:
    print("\n1. the wire, stage side: µs per float32 hidden state [tokens, hidden] (medians), each removed copy alone")
    print(f"{'shape':>11} {'encode: CopyFrom':>17} {'in place':>9} {'decode: bytearray':>18} {'view':>7} "
          f"{'whole decode now':>17}")
    for r in rows:
        print(f"{str([r['tokens'], r['hidden']]):>11} {r['encode_before_us']:>17.2f} {r['encode_after_us']:>9.2f} "
              f"{r['decode_before_us']:>18.2f} {r['decode_after_us']:>7.2f} {r['whole_decode_us']:>17.2f}")


def print_breakdown(chain: dict) -> None:
    stages = list(chain["breakdown_us"])
    print(f"   per-step breakdown, µs per step ({chain['system']}):")
    print(f"   {'phase':<12}" + "".join(f"{'stage ' + s:>14}" for s in stages))
    for p in PHASES:
        print(f"   {p:<12}" + "".join(f"{chain['breakdown_us'][s][p]:>14.1f}" for s in stages))
    sums = [sum(chain["breakdown_us"][s].values()) for s in stages]
    print(f"   {'sum':<12}" + "".join(f"{x:>14.1f}" for x in sums))
    rest = chain["ms_per_token"] * 1000 - sum(sums)
    # N + 1 hops: stages forward to each other (the default), and one stage answers the router itself.
    print(f"   token {chain['ms_per_token'] * 1000:.0f} µs at the router; beyond both stages' phases (gRPC, event "
          f"loops, router, {len(stages) + 1} hops): {rest:.0f} µs ({rest / (chain['ms_per_token'] * 1000):.0%})")


def print_tiny(hf: dict, chains: list[dict]) -> None:
    print("\n2. tiny Llama, single-stream greedy decode (1 thread per process)")
    print(f"   transformers generate(): {hf['ms_per_token']:.2f} ms/token")
    for c in chains:
        same = "identical tokens" if c["ids"] == hf["ids"] else "TOKENS DIFFER from transformers"
        print(f"   {c['system']}: {c['ms_per_token']:.2f} ms/token, {hf['ms_per_token'] / c['ms_per_token']:.2f}x "
              f"transformers; cold start {max(c['cold_start_s'].values()):.1f}s; {same}")
    print("\n3. where a step's time goes")
    for c in chains:
        print_breakdown(c)


def print_medium(ceilings: dict, chains: list[dict], hf: dict | None) -> None:
    one, two = ceilings["1"], ceilings["2"]
    print(f"\n4. ~270M Llama, {one['weight_bytes'] / 2**20:.0f} MiB of float32 weights per token")
    print(f"   ceilings (fastest GEMV run over the weights' size): 1 thread {one['bytes_per_s'] / 1e9:.1f} GB/s = "
          f"{one['ms_per_token']:.1f} ms/token; 2 threads {two['bytes_per_s'] / 1e9:.1f} GB/s = "
          f"{two['ms_per_token']:.1f} ms/token")
    for c in (one, two):
        methods = ", ".join(f"{m} {b / 1e9:.1f}" for m, b in (c.get("methods_bytes_per_s") or {}).items())
        print(f"   {c['threads']} thread(s), median GB/s by method: {methods} (the ceiling: {c.get('method')})")
    if hf:
        print(f"   transformers generate() (1 thread): {hf['ms_per_token']:.1f} ms/token, "
              f"{one['ms_per_token'] / hf['ms_per_token']:.0%} of the 1-thread ceiling")
    for c in chains:
        ref = one if "x 1 thread" in c["system"] else two
        print(f"   {c['system']}: {c['ms_per_token']:.1f} ms/token = {ref['ms_per_token'] / c['ms_per_token']:.0%} of "
              f"the {ref['threads']}-thread ceiling")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the wire and the tiny chain only, few tokens, no --compile")
    p.add_argument("--no-medium", action="store_true", help="skip the ~270M model")
    p.add_argument("--no-compile", action="store_true", help="skip the tiny chain with --compile")
    p.add_argument("--medium-compile", action="store_true", help="the ~270M layouts with --compile too")
    p.add_argument("--also-with", action="append", default=[], metavar="FLAG",
                   help="the tiny chain once more with this stage flag (repeat for several flags in that one arm)")
    p.add_argument("--repeats", type=int, default=5, help="decode runs per system (medians)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per decode run (tiny model; ~270M: a quarter)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--code", action="append", type=Path, default=[], help="a checkout to measure (repeatable)")
    p.add_argument("--rounds", type=int, default=1, help="with --code: runs of each tree, in turns")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Trees side by side


def headline(report: dict) -> dict[str, float]:
    """The figures of one run a comparison looks at: ms per token of each system, each stage's model phase."""
    out = {"tiny transformers": report["tiny"]["transformers"]["ms_per_token"]}
    for chain in report["tiny"]["chains"]:
        out[f"tiny {chain['system']}"] = chain["ms_per_token"]
        out |= {f"  {chain['system']}: stage {k}'s model phase, µs": v["model"]
                for k, v in chain["breakdown_us"].items()}  # keyed by chain: --also-with and --compile add chains
    for chain in report.get("medium", {}).get("chains", []):
        out[f"~270M {chain['system']}"] = chain["ms_per_token"]
    return out


def tree_flags(args: argparse.Namespace) -> list[str]:
    """The flags each tree's own run takes: all but --code, --rounds and --out."""
    flags = [f"--{name.replace('_', '-')}" for name in ("quick", "no_medium", "no_compile", "medium_compile")
             if getattr(args, name)]
    return flags + [f"--also-with={f}" for f in args.also_with] + ["--repeats", str(args.repeats), "--tokens",
                                                                  str(args.tokens)]


def compare_trees(args: argparse.Namespace) -> None:
    """Each --code tree's bench_floor.py with the other flags, --rounds times in turns; medians side by side."""
    trees = [c.resolve() for c in args.code]
    runs: list[dict[str, list[float]]] = [{} for _ in trees]
    for r in range(args.rounds):
        for i, tree in enumerate(trees):
            out = args.out.resolve() / f"{i}-{tree.name}-{r}"
            script = tree / "scripts" / "dev" / "bench_floor.py"
            if not script.exists():  # a tree from before the developers' scripts moved to scripts/dev/
                script = tree / "scripts" / "bench_floor.py"
            proc = subprocess.run([sys.executable, str(script), *tree_flags(args),
                                   "--out", str(out)], cwd=tree, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{tree}: bench_floor failed:\n{proc.stderr[-3000:]}")
            for k, v in headline(json.loads((out / "floor.json").read_text())).items():
                runs[i].setdefault(k, []).append(v)
            print(f"  round {r + 1}, {tree}: {out / 'floor.json'}", flush=True)
    print(f"\nmedians of {args.rounds} run(s) per tree [runs], x the first tree (ms/token unless marked)")
    for key in runs[0]:
        print(f"  {key}")
        for tree, tree_runs in zip(trees, runs, strict=True):
            values = tree_runs.get(key, [])
            if values:
                m, base = statistics.median(values), statistics.median(runs[0][key])
                print(f"      {str(tree):40s} {m:9.2f} [{', '.join(f'{x:.2f}' for x in values)}] {m / base:.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.code:
        return compare_trees(args)
    if args.quick:
        args.no_medium = args.no_compile = True
        args.repeats, args.tokens = 2, 16
    t0 = time.perf_counter()
    from transformers import AutoConfig

    report: dict = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": {k: str(v) for k, v in
                                                                                     vars(args).items()}}}
    report["wire"] = wire_micro(2000 if args.quick else 20000)
    print_wire(report["wire"])

    args.out.mkdir(parents=True, exist_ok=True)
    notes: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="stagemesh-floor-") as tmp:
        tiny = str(bench.resolve_model(bench.parse_args([])))
        config = AutoConfig.from_pretrained(tiny, local_files_only=True)
        plan = small_plan(args.repeats, args.tokens)
        w = bench.make_workload(plan, config.vocab_size, config.max_position_embeddings)
        print("\ntiny: transformers generate(), 1 thread", flush=True)
        hf = disturbed(notes, "tiny transformers", run_transformers, tiny, 1, plan, w, Path(tmp))
        chains = []
        for extra in [[], *([args.also_with] if args.also_with else []), *([] if args.no_compile else [["--compile"]])]:
            print(f"tiny: 2-stage chain, 1 thread per stage {' '.join(extra)}", flush=True)
            chains.append(disturbed(notes, f"tiny chain {' '.join(extra)}".strip(), run_chain, tiny, 2, 1, plan, w,
                                    args.out / "logs" / f"floor-tiny{len(chains)}", extra))
        report["tiny"] = {"transformers": hf, "chains": chains}
        print_tiny(hf, chains)

        if not args.no_medium:
            medium = str(bench.resolve_model(bench.parse_args(["--medium"])))
            config = AutoConfig.from_pretrained(medium, local_files_only=True)
            mplan = small_plan(max(3, args.repeats // 2), max(16, args.tokens // 4))
            mw = bench.make_workload(mplan, config.vocab_size, config.max_position_embeddings)
            print("\n~270M: bandwidth ceilings, transformers, chains", flush=True)
            # Measured before and after the chains, the faster kept: a busy machine only lowers a ceiling.
            first = {n: disturbed(notes, f"ceiling {n}", ceiling, medium, n, 9, Path(tmp)) for n in (1, 2)}
            mhf = disturbed(notes, "~270M transformers", run_transformers, medium, 1, mplan, mw, Path(tmp))
            layouts = [(2, 1, []), (1, 2, [])] + ([(2, 1, ["--compile"]), (1, 2, ["--compile"])]
                                                  if args.medium_compile else [])
            mchains = [disturbed(notes, f"~270M {n}x{t} {' '.join(extra)}".strip(), run_chain, medium, n, t, mplan, mw,
                                 args.out / "logs" / f"floor-medium-{n}x{t}{'-compile' if extra else ''}", extra)
                       for n, t, extra in layouts]
            ceilings = {str(n): best_ceiling(first[n], ceiling(medium, n, 9, Path(tmp))) for n in (1, 2)}
            report["medium"] = {"ceilings": ceilings, "transformers": mhf, "chains": mchains}
            print_medium(ceilings, mchains, mhf)
            for c in mchains:
                print_breakdown(c)
    report["meta"]["foreign_cpu_share"] = notes
    busy = {k: v for k, v in notes.items() if v > 0.05}
    if busy:
        print("\nnote: other processes used the CPUs meanwhile (share of all CPU time): "
              + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()) + "; those numbers are disturbed")
    report["meta"]["seconds"] = time.perf_counter() - t0
    (args.out / "floor.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out / 'floor.json'} in {report['meta']['seconds']:.0f}s (the machine is shared: medians, "
          "and ratios within one run)", flush=True)


if __name__ == "__main__":
    main()
