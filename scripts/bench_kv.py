"""The KV scenario of the paged pool: callers that ask for far more tokens than they use.

    python scripts/bench_kv.py                      # the tiny model, a 2-stage chain, ~2 min on 2 cores
    python scripts/bench_kv.py --code /tmp/old-tree  # the same against another checkout's stage code

A pool sized for SESSIONS sessions of prompt + USED tokens; SESSIONS streams that each ask for ASKED new
tokens and stop within USED, all at once, through a real mesh (stage and router processes). The stop: the
tiny checkpoint is random and greedy decoding reaches no common eos, so each stream carries a stop string,
the last 4 characters its greedy text reaches for the first time between 3/4 of USED tokens and USED
(found with transformers' generate() and the tokenizer): the router ends it there, as it would at an eos.
Reports how many streams finished at their stop,
how many were refused, the peak pool use (Stage/Info, polled), preemptions, and wall time; and what the
reservation of prompt + max_new_tokens at open (the stage code before the paged pool) would admit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

FIRST_ORDINARY_ID = 4
BLOCK = 16  # the stage's default --kv-block-size


def choose_prompts(model_dir: str, sessions: int, used: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """(prompts, stop strings): greedy decoding of each prompt writes its stop string for the first time
    between 3/4 of `used` tokens and `used` (found with transformers' generate() and the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    prompts, stops = [], []
    with torch.inference_mode():
        for _ in range(8 * sessions):
            if len(prompts) == sessions:
                break
            p = [rng.randrange(FIRST_ORDINARY_ID, hf.config.vocab_size) for _ in range(rng.randint(16, 40))]
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=used, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for k in range(used, 3 * used // 4, -1):
                text = tokenizer.decode(out[:k])
                stop = text[-4:]
                if len(stop.strip()) == 4 and text.find(stop) == len(text) - 4:
                    prompts.append(p)
                    stops.append(stop)
                    break
    if len(prompts) < sessions:
        raise SystemExit(f"found stop strings for {len(prompts)} of {sessions} prompts")
    return prompts, stops


async def run_streams(address: str, stage_addresses: list[str], prompts: list[list[int]], stops: list[str],
                      asked: int) -> dict:
    import grpc

    from stagemesh.v1 import router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc

    peak = {"bytes": 0, "blocks": 0, "sessions": 0}
    done = asyncio.Event()

    async def poll() -> None:
        channels = [grpc.aio.insecure_channel(a) for a in stage_addresses]
        stubs = [stage_pb2_grpc.StageStub(c) for c in channels]
        try:
            while not done.is_set():
                infos = await asyncio.gather(*(s.Info(stage_pb2.InfoRequest(), timeout=10) for s in stubs))
                peak["bytes"] = max(peak["bytes"], max(i.kv_used_bytes for i in infos))
                peak["blocks"] = max(peak["blocks"], max(i.kv_blocks_used for i in infos))
                peak["sessions"] = max(peak["sessions"], max(i.open_sessions for i in infos))
                peak["capacity_bytes"] = infos[0].kv_capacity_bytes
                peak["blocks_total"] = infos[0].kv_blocks_total
                peak["preemptions"] = sum(i.kv_preemptions for i in infos)
                await asyncio.sleep(0.01)
        finally:
            for c in channels:
                await c.close()

    async def stream(stub, ids: list[int], stop: str) -> tuple[str, int]:
        n, reason = 0, ""
        request = router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=asked, temperature=0.0, priority=-1,
                                             stop=[stop])
        try:
            async for r in stub.Generate(request, timeout=1800):
                n += len(r.token_ids)
                if r.finish_reason:
                    reason = router_pb2.FinishReason.Name(r.finish_reason)
        except grpc.aio.AioRpcError as exc:
            reason = exc.code().name
        return reason, n

    poller = asyncio.ensure_future(poll())
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream(stub, p, s) for p, s in zip(prompts, stops, strict=True)))
        seconds = time.perf_counter() - t0
    done.set()
    await poller
    return {"seconds": seconds, "finish": dict(Counter(r for r, _ in results)),
            "tokens": sum(n for _, n in results), "max_tokens": max(n for _, n in results), "peak": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local checkpoint (default: the tiny model in models/tiny-llama)")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--used", type=int, default=64, help="new tokens the pool is sized for (the eos comes sooner)")
    p.add_argument("--asked", type=int, default=1024, help="max_new_tokens each stream asks for")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--code", type=Path, help="run the stage and router processes from this checkout instead")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()

    from stagemesh.launcher import ensure_tiny_model, start_local_mesh

    model = args.model or str(ensure_tiny_model(ROOT / "models" / "tiny-llama"))
    config = json.loads((Path(model) / "config.json").read_text())
    t0 = time.perf_counter()
    cache = ROOT / "bench-out" / f"kv-prompts-{Path(model).name}-{args.sessions}-{args.used}-{args.seed}.json"
    if cache.exists():  # finding them takes minutes on 2 cores
        prompts, stops = json.loads(cache.read_text())
    else:
        prompts, stops = choose_prompts(model, args.sessions, args.used, args.seed)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps([prompts, stops]))
    print(f"{len(prompts)} prompts whose greedy text reaches its stop string within {args.used} tokens "
          f"({time.perf_counter() - t0:.0f}s to find)", flush=True)
    layers = config["num_hidden_layers"] // args.stages
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = 2 * layers * kv_heads * BLOCK * head_dim * 4
    blocks = sum(-(-(len(p) + args.used) // BLOCK) for p in prompts)
    kv_gb = (blocks + 1) * block_bytes / 2**30  # + the pool's null block
    per_old_session = [2 * layers * kv_heads * (len(p) + args.asked) * head_dim * 4 for p in prompts]
    old_admitted = 0
    budget = blocks * block_bytes
    for need in per_old_session:
        if need > budget:
            break
        budget -= need
        old_admitted += 1
    print(f"pool per stage: {blocks} blocks of {BLOCK} positions ({kv_gb * 2**30 / 2**20:.2f} MiB); reserving "
          f"prompt + {args.asked} at open would admit {old_admitted} of {len(prompts)} sessions", flush=True)
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-kv-") as tmp:
        (Path(tmp) / "logs").mkdir()
        cwd = os.getcwd()
        if args.code:
            os.chdir(args.code)  # `python -m stagemesh.cli` in the children imports that tree
        mesh, router = start_local_mesh(model, stages=args.stages, replicas=1, router_port=0, threads=1,
                                        extra_stage_args=["--device", "cpu", "--kv-cache-gb", f"{kv_gb:.9f}"],
                                        # every stream at once: the router admits no fewer per chain
                                        extra_router_args=["--slots-per-chain", str(len(prompts))],
                                        log_dir=Path(tmp) / "logs")
        os.chdir(cwd)
        try:
            stage_addresses = [proc.address for proc in mesh.processes if proc.name.startswith("stage")]
            out = asyncio.run(run_streams(router.address, stage_addresses, prompts, stops, args.asked))
        finally:
            mesh.stop()
    peak = out["peak"]
    print(json.dumps({"sessions": len(prompts), "asked": args.asked, **out}, indent=1))
    print(f"\n{len(prompts)} streams asking {args.asked} tokens each, pool sized for prompt + {args.used}: "
          f"finish {out['finish']}, {out['tokens']} tokens (longest {out['max_tokens']}) in {out['seconds']:.1f}s; "
          f"peak pool use {peak['bytes'] / max(1, peak.get('capacity_bytes', 1)):.0%} "
          f"({peak['blocks']} of {peak.get('blocks_total', 0)} blocks), peak open sessions per stage "
          f"{peak['sessions']}, preemptions {peak.get('preemptions', 0)}", flush=True)


if __name__ == "__main__":
    main()
