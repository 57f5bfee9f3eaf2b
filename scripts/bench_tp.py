"""A tensor-parallel stage beside the same stage in one process: prefill and decode ms/token, side by side.

    python scripts/bench.py --tp 2 --medium        # the ~270M Llama (models/llama-270m), ~3 min on 2 cores
    python scripts/bench_tp.py --tp 2 --quick      # the tiny model, a smoke run

Two stage processes hold the whole model (layers 0:N), both up for the whole run: (a) one process with
--threads K; (b) `--tp K --threads 1`, K ranks of one thread each (the same cores in all). Rounds alternate
(a), (b), (a), ... so that other load on the machine falls on both alike; each round is one session:
a prefill of --prompt tokens in one step (ms per prompt token), then --decode one-token steps (the median
step is the decode ms/token). Steps go straight to the stage (router.session, no router), so the
figures are the stage's and its gRPC hop's. Medians over rounds; the ratio is (b) / (a): below 1, TP is faster.
On CUDA (--device cuda, NCCL) each rank takes its own device; that needs K devices.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.measure_memory import ensure_medium_model  # noqa: E402
from stagemesh.launcher import LocalMesh, ensure_tiny_model, stage_env  # noqa: E402
from stagemesh.router.chain_client import Chain, Progress, StageEndpoint  # noqa: E402
from stagemesh.router.session import ChainSession  # noqa: E402
from stagemesh.router.step_values import Sampling  # noqa: E402

FIRST_ORDINARY_ID = 4


async def one_round(address: str, prompt: list[int], decode: int) -> tuple[float, float]:
    """(prefill ms per prompt token, median decode ms per token) of one session on the stage."""
    chain = Chain([StageEndpoint(address)])
    try:
        async with ChainSession(chain, max_length=len(prompt) + decode + 1, request_id="bench-tp",
                                progress=Progress(floor_s=600.0)) as session:  # a slow prefill is no hang here
            t0 = time.perf_counter()
            response = await session.step(prompt, sampling=Sampling())
            prefill_ms = (time.perf_counter() - t0) * 1000 / len(prompt)
            steps = []
            for _ in range(decode):
                t0 = time.perf_counter()
                response = await session.step([response.token_id], sampling=Sampling())
                steps.append((time.perf_counter() - t0) * 1000)
    finally:
        await chain.stages[0].close()
    return prefill_ms, statistics.median(steps)


async def measure(layouts: dict[str, str], rounds: int, prompt: list[int], decode: int) -> dict[str, dict]:
    got: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in layouts}
    for address in layouts.values():
        await one_round(address, prompt[:16], 4)  # warm: first-use costs out of the figures
    for _ in range(rounds):
        for name, address in layouts.items():
            prefill, dec = await one_round(address, prompt, decode)
            got[name]["prefill"].append(prefill)
            got[name]["decode"].append(dec)
    return {name: {k: statistics.median(v) for k, v in d.items()} | {"runs": d} for name, d in got.items()}


def run_tp_rows(model: str, tp: int, *, device: str = "cpu", dtype: str = "float32", rounds: int = 7,
                prompt_tokens: int = 512, decode: int = 32, out: Path = Path("bench-out")) -> dict:
    config = json.loads((Path(model) / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    prompt = [FIRST_ORDINARY_ID + (7 * i) % (config["vocab_size"] - FIRST_ORDINARY_ID) for i in range(prompt_tokens)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs-tp").mkdir(exist_ok=True)
    mesh = LocalMesh(model, out / "logs-tp")
    common = ["stage", "--model", model, "--layers", f"0:{n_layers}", "--port", "0", "--device", device,
              "--dtype", dtype, "--kv-cache-gb", "0.5", "--drain-timeout-s", "1"]
    names = {"one process": f"1 process x {tp} threads", "tp": f"TP-{tp}: {tp} ranks x 1 thread"}
    try:
        one = mesh.spawn("stage-one", [*common, "--threads", str(tp)], stage_env(tp), timeout=600)
        wide = mesh.spawn("stage-tp", [*common, "--threads", "1", "--tp", str(tp)], stage_env(1), timeout=600)
        layouts = {names["one process"]: one.address, names["tp"]: wide.address}
        result = asyncio.run(measure(layouts, rounds, prompt, decode))
    finally:
        mesh.shutdown(wait_s=15)
    a, b = result[names["one process"]], result[names["tp"]]
    report = {"model": model, "tp": tp, "device": device, "dtype": dtype, "rounds": rounds, "prompt_tokens":
              prompt_tokens, "decode_steps": decode, "date": time.strftime("%Y-%m-%d"), "layouts": result,
              "ratio_tp_over_one": {k: b[k] / a[k] for k in ("prefill", "decode")}}
    (out / "bench_tp.json").write_text(json.dumps(report, indent=1))
    print(f"\n{Path(model).name}, {dtype} on {device}, {rounds} alternating rounds, medians "
          f"(prefill: {prompt_tokens} tokens in one step; decode: median of {decode} steps)")
    print(f"{'layout':<28} {'prefill ms/token':>17} {'decode ms/token':>16}")
    for name, r in result.items():
        print(f"{name:<28} {r['prefill']:>17.3f} {r['decode']:>16.2f}")
    ratio = report["ratio_tp_over_one"]
    print(f"{'TP / one process':<28} {ratio['prefill']:>17.2f} {ratio['decode']:>16.2f}")
    if device == "cpu":
        print("GPU (NCCL) figures: pending — run with --device cuda on a host with K devices")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="local Hugging Face checkpoint (default: the tiny model)")
    which.add_argument("--medium", action="store_true", help="the ~270M Llama in models/llama-270m")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill step")
    p.add_argument("--decode", type=int, default=32, help="decode steps per round")
    p.add_argument("--quick", action="store_true", help="3 rounds, a 64-token prompt, 8 decode steps")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    model = args.model or str(ensure_medium_model(ROOT / "models" / "llama-270m") if args.medium
                              else ensure_tiny_model(ROOT / "models" / "tiny-llama"))
    if args.quick:
        args.rounds, args.prompt, args.decode = 3, 64, 8
    run_tp_rows(model, args.tp, device=args.device, dtype=args.dtype, rounds=args.rounds,
                prompt_tokens=args.prompt, decode=args.decode, out=args.out)


if __name__ == "__main__":
    main()
