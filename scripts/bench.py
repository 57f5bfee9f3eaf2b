"""stagemesh against transformers, on one machine: the same model, the same prompts, medians of repeated runs.

    python scripts/bench.py             # the tiny model (made in models/tiny-llama if absent): 15-20 min on 2 cores
    python scripts/bench.py --quick     # a smoke run, about 1 min on 2 cores (CI runs it; asserts nothing on speed)
    python scripts/bench.py --medium    # a ~270M Llama (made in models/llama-270m if absent): 1 and 2 stages,
                                        # 1 and 32 streams, ~22 min; --stages/--replicas/--levels widen it
    python scripts/bench.py --model DIR --dtype bfloat16 --threads 2 --out bench-out/
    python scripts/bench.py --tp 2 --medium # the TP rows: a TP-2 stage beside one process with 2 threads
                                        # (scripts/bench_tp.py), prefill and decode ms/token, ~3 min

(a) is transformers' generate() in one process (a subprocess of this script, so its peak RSS is its own and
its torch threads never share the cores with the mesh); (b) is a stagemesh started with start_local_mesh:
stage and router processes, called through the router's Generate stream with grpc.aio. The two never run
at the same time. Everything runs on the CPU (--device cuda: stages, transformers and the GEMV on the GPU).
Metrics, each the median over repeated runs:

1. single-stream greedy decode tokens/s: first streamed token to last (and end to end, from the call);
2. time to first token for 32-, 512- and 2048-token prompts (those that fit the model's context); the mesh
   with pipelined chunked prefill on (--prefill-chunk, default 256) and off (0);
3. aggregate tokens/s of 1..64 concurrent streams of mixed lengths (prompts 16..512, outputs 16..256
   tokens, fixed seed); transformers gets each level as one left-padded generate() call;
4. peak RSS (VmHWM) of every process;
5. the memory-bandwidth limit of batch-1 decode: float32 GEMV bandwidth / bytes of weights per token.

Writes DIR/bench.json (raw numbers) and DIR/bench.png (tokens/s against concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# stagemesh is imported inside the workers, never here: bench_aggregate.py imports this file and then runs its
# worker in another tree (--code), whose own stagemesh must be the one it imports.

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY_DIR = ROOT / "models" / "tiny-llama"
MEDIUM_DIR = ROOT / "models" / "llama-270m"
FIRST_ORDINARY_ID = 4  # ids 0..3 are <s>, </s>, <pad>, <unk> in the models make_tiny_model.py writes
SEED = 1234
STREAM_TIMEOUT_S = 1800.0  # a guard against a stuck mesh, far above any run
READY_TIMEOUT_S = 900.0  # a stage compiling its slice with inductor's cache cold takes minutes to be ready
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------------------------------
# What to run


@dataclass
class Plan:
    stages: list[int]
    replicas: list[int]
    levels: list[int]  # concurrent streams
    repeats: int  # single-stream metrics (decode, TTFT)
    concurrency_repeats: int
    decode_tokens: int = 128
    decode_prompt_tokens: int = 32
    ttft_lengths: tuple[int, ...] = (32, 512, 2048)
    prompt_range: tuple[int, int] = (16, 512)
    output_range: tuple[int, int] = (16, 256)
    gemv_gib: float = 1.5
    gemv_runs: int = 15


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan(stages=[1, 2], replicas=[1], levels=[1, 4], repeats=2, concurrency_repeats=2, decode_tokens=32,
                    ttft_lengths=(32, 256), prompt_range=(16, 128), output_range=(8, 48), gemv_gib=0.5, gemv_runs=5)
    elif args.medium:  # ~22 minutes on 2 cores (transformers alone ~12: 32 padded streams twice); widen below
        plan = Plan(stages=[1, 2], replicas=[1], levels=[1, 32], repeats=3, concurrency_repeats=2)
    else:
        plan = Plan(stages=[1, 2, 4], replicas=[1, 2], levels=[1, 4, 16, 32, 64], repeats=5, concurrency_repeats=3)
    if args.stages:
        plan.stages = args.stages
    if args.replicas:
        plan.replicas = args.replicas
    if args.levels:
        plan.levels = args.levels
    if args.repeats:
        plan.repeats = plan.concurrency_repeats = args.repeats
    return plan


@dataclass
class Workload:
    """Token-id prompts, the same for both systems (no tokenizer round trip can make them differ)."""

    decode_prompt: list[int]
    ttft_prompts: dict[str, list[int]]  # prompt length -> ids, only lengths that fit the context
    ttft_skipped: dict[str, str]  # prompt length -> why not
    streams: list[tuple[list[int], int]]  # (prompt ids, max_new_tokens); level k runs the first k


def make_workload(plan: Plan, vocab_size: int, max_position: int) -> Workload:
    def ids(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]

    # One generator per part, so that what one part draws never shifts another's prompts.
    decode_prompt = ids(random.Random(f"{SEED}-decode"), plan.decode_prompt_tokens)
    ttft, skipped = {}, {}
    for n in plan.ttft_lengths:
        if n + 1 <= max_position:
            ttft[str(n)] = ids(random.Random(f"{SEED}-ttft-{n}"), n)
        else:
            skipped[str(n)] = f"{n} prompt tokens + 1 new exceed the model's context of {max_position}"
    rng = random.Random(f"{SEED}-streams")
    streams = []
    for _ in range(max(plan.levels)):
        n_out = rng.randint(*plan.output_range)
        n_prompt = min(rng.randint(*plan.prompt_range), max_position - n_out)
        streams.append((ids(rng, n_prompt), n_out))
    return Workload(decode_prompt, ttft, skipped, streams)


# --------------------------------------------------------------------------------------------------
# Results


@dataclass
class SystemResult:
    """One system's raw numbers: every list holds one value per run."""

    system: str
    stages: int = 0
    replicas: int = 0
    prefill_chunk: int | None = None
    decode_tok_s: list[float] = field(default_factory=list)  # first streamed token to last
    decode_e2e_tok_s: list[float] = field(default_factory=list)  # call to last token
    decode_tokens: list[int] = field(default_factory=list)
    decode_ids: list[int] = field(default_factory=list)  # the greedy tokens of the last run
    ttft_s: dict[str, list[float]] = field(default_factory=dict)  # prompt length -> seconds
    ttft_nochunk_s: dict[str, list[float]] = field(default_factory=dict)  # mesh with --prefill-chunk 0
    concurrency_tok_s: dict[str, list[float]] = field(default_factory=dict)  # streams -> aggregate tokens/s
    concurrency_tokens: dict[str, list[int]] = field(default_factory=dict)
    concurrency_errors: dict[str, list[str]] = field(default_factory=dict)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)  # process -> VmHWM
    weight_bytes: dict[str, int] = field(default_factory=dict)  # process -> bytes of weights it holds
    seconds: float = 0.0  # wall time spent on this system, start-up included

    def medians(self) -> dict:
        def med(d: dict[str, list[float]]) -> dict[str, float]:
            return {k: statistics.median(v) for k, v in d.items() if v}

        return {
            "decode_tok_s": median_or_none(self.decode_tok_s),
            "decode_e2e_tok_s": median_or_none(self.decode_e2e_tok_s),
            "ttft_s": med(self.ttft_s),
            "ttft_nochunk_s": med(self.ttft_nochunk_s),
            "concurrency_tok_s": med(self.concurrency_tok_s),
            "peak_rss_max_bytes": max(self.peak_rss_bytes.values(), default=None),
            "peak_rss_sum_bytes": sum(self.peak_rss_bytes.values()) if self.peak_rss_bytes else None,
        }

    def to_json(self) -> dict:
        return {**asdict(self), "medians": self.medians()}


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def decode_rates(t_call: float, marks: list[tuple[float, int]]) -> tuple[float, float, int]:
    """(tokens/s from the first token to the last, tokens/s from the call to the last token, tokens)
    from (time, tokens) of each streamed message."""
    n = sum(k for _, k in marks)
    first_t, first_n = marks[0]
    last_t = marks[-1][0]
    decode = (n - first_n) / (last_t - first_t) if last_t > first_t else float("nan")
    return decode, n / (last_t - t_call), n


def cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds the whole machine has been busy, CPU-seconds of this process and its reaped children).
    Their growth apart is other people's work on the machine, which disturbs every number here."""
    ours = sum(os.times()[:4])
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = ours
    return busy, ours


def foreign_share(before: tuple[float, float], wall_s: float) -> float:
    """Share of the machine's CPU time that processes other than ours used since `before`."""
    busy, ours = cpu_seconds()
    return max(0.0, (busy - before[0]) - (ours - before[1])) / (wall_s * (os.cpu_count() or 1))


# --------------------------------------------------------------------------------------------------
# Workers: run in a subprocess of this script (python scripts/bench.py --worker NAME --spec F --result F)


def gemv_worker(spec: dict) -> dict:
    """Memory bandwidth as a float32 matrix-vector product streams it: what batch-1 decode is bound by. On the CPU
    the faster of torch's GEMV (MKL) and stagemesh's packed kernel over the same bytes (a stage's Linears use the
    kernel): on an AMD EPYC MKL's GEMV runs no faster on two threads than on one, so it alone understates what two
    threads can stream."""
    import torch

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec.get("device", "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cols = 8192
    rows = int(spec["gib"] * 2**30) // (4 * cols) // 16 * 16

    def timed(fn) -> list[float]:
        for _ in range(2):
            fn()
        times = []
        for _ in range(spec["runs"]):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return times

    def mv(huge: bool = False) -> list[float]:
        matrix = (huge_pages.zeros((rows, cols), torch.float32) if huge
                  else torch.empty(rows, cols, dtype=torch.float32, device=device)).fill_(1e-3)  # every page touched
        return timed(lambda: torch.mv(matrix, vector))

    def packed(huge: bool = False) -> list[float]:
        shape = (rows // 16, cols, 16)  # the same bytes, as packed_weights.py holds them
        panels = (huge_pages.zeros(shape, torch.float32) if huge else torch.empty(shape)).fill_(1e-3)
        return timed(lambda: torch.ops.stagemesh.packed_linear(vector[None], panels, None, rows))

    vector = torch.full((cols,), 1e-3, dtype=torch.float32, device=device)
    nbytes = rows * cols * 4
    methods = {"torch.mv": mv()}  # one matrix at a time: each freed on return
    if device.type == "cpu":
        from stagemesh.stage_server.cpu import cpu_kernels, huge_pages

        # A stage's packed weights lie on 2 MiB pages (huge_pages.py): a ceiling is the fastest either way.
        methods["torch.mv, 2 MiB pages"] = mv(huge=True)
        if cpu_kernels.load():
            methods["packed kernel"] = packed()
            methods["packed kernel, 2 MiB pages"] = packed(huge=True)
    best = min(methods, key=lambda m: statistics.median(methods[m]))
    return {"matrix_bytes": nbytes, "threads": spec["threads"], "seconds": methods[best], "method": best,
            "methods_bytes_per_s": {m: nbytes / statistics.median(t) for m, t in methods.items()},
            "bytes_per_s": nbytes / statistics.median(methods[best])}


class _TimingStreamer:
    """transformers streamer that notes when each new token appears (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.marks.append((time.perf_counter(), int(value.numel())))
        self._prompt_seen = True

    def end(self) -> None:
        pass


def transformers_worker(spec: dict) -> dict:
    """(a): transformers' generate() on the whole model in this one process."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    device = spec.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).to(device).eval()
    eos = model.generation_config.eos_token_id  # what the router stops on too
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = min(eos_ids, default=0)
    result = SystemResult("transformers")
    started = time.perf_counter()

    def generate(ids: list[int], max_new_tokens: int) -> tuple[float, list[tuple[float, int]], list[int]]:
        streamer = _TimingStreamer()
        input_ids = torch.tensor([ids], device=device)
        t_call = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad_id, streamer=streamer)
        return t_call, streamer.marks, out[0, len(ids):].tolist()

    w = spec["workload"]
    generate(w["decode_prompt"], 8)  # warm-up
    for _ in range(spec["repeats"]):
        t_call, marks, ids = generate(w["decode_prompt"], spec["decode_tokens"])
        decode, e2e, n = decode_rates(t_call, marks)
        result.decode_tok_s.append(decode)
        result.decode_e2e_tok_s.append(e2e)
        result.decode_tokens.append(n)
        result.decode_ids = ids

    for length, prompt in w["ttft_prompts"].items():
        generate(prompt, 1)  # warm-up for this shape
        for _ in range(spec["repeats"]):
            t_call, marks, _ = generate(prompt, 1)
            result.ttft_s.setdefault(length, []).append(marks[0][0] - t_call)

    def batch(streams: list[tuple[list[int], int]]) -> tuple[float, int]:
        """One static, left-padded batch, generated to the longest output asked for; only each stream's own
        tokens (up to its max_new_tokens or its end-of-sequence token) count as produced."""
        width = max(len(p) for p, _ in streams)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in streams], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in streams], device=device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max(n for _, n in streams),
                                 do_sample=False, pad_token_id=pad_id)
        seconds = time.perf_counter() - t
        produced = 0
        for row, (_, n) in zip(out[:, width:].tolist(), streams, strict=True):
            row = row[:n]
            ends = [i for i, tok in enumerate(row) if tok in eos_ids]
            produced += ends[0] + 1 if ends else len(row)
        return seconds, produced

    batch(w["streams"][:2])  # warm-up of the padded path
    for level in spec["levels"]:
        for _ in range(spec["concurrency_repeats"]):
            seconds, produced = batch(w["streams"][:level])
            result.concurrency_tok_s.setdefault(str(level), []).append(produced / seconds)
            result.concurrency_tokens.setdefault(str(level), []).append(produced)

    from stagemesh.processes import peak_rss_bytes

    result.seconds = time.perf_counter() - started
    result.peak_rss_bytes = {"transformers": peak_rss_bytes() or 0}
    result.weight_bytes = {"transformers": sum(p.numel() * p.element_size() for p in model.parameters())}
    return asdict(result)


WORKERS = {"gemv": gemv_worker, "transformers": transformers_worker}


def uninterrupted(fn) -> None:
    """Runs a clean-up with Ctrl-C and SIGTERM held off, so a second one cannot leave processes behind."""
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        fn()
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def kill_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run_worker(name: str, spec: dict, threads: int, tmp: Path) -> dict:
    """Runs a worker in a child process; killed with us on Ctrl-C or any error."""
    spec_path, result_path = tmp / f"{name}-spec.json", tmp / f"{name}-result.json"
    from stagemesh.launcher import stage_env

    spec_path.write_text(json.dumps(spec))
    env = stage_env(threads, shared_cores=False)  # alone on the cores, as a mesh's stages are when they fit
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", str(spec_path),
           "--result", str(result_path)]
    proc = subprocess.Popen(cmd, env=env)
    try:
        if proc.wait() != 0:
            raise RuntimeError(f"the {name} worker failed with exit code {proc.returncode}")
    finally:
        uninterrupted(lambda: kill_process(proc))
    return json.loads(result_path.read_text())


# --------------------------------------------------------------------------------------------------
# (b): the mesh, through the router's Generate stream


async def mesh_stream(stub, ids: list[int], max_new_tokens: int, priority: int = 0):
    """(call time, [(time, tokens)] per streamed message, token ids)."""
    from stagemesh.v1 import router_pb2

    request = router_pb2.GenerateRequest(token_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                         priority=priority)
    marks, tokens = [], []
    t_call = time.perf_counter()
    async for response in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
        if response.token_ids:
            marks.append((time.perf_counter(), len(response.token_ids)))
            tokens.extend(response.token_ids)
    return t_call, marks, tokens


def router_stub(channel):
    from stagemesh.v1 import router_pb2_grpc

    return router_pb2_grpc.RouterStub(channel)


async def mesh_decode(address: str, w: Workload, plan: Plan, result: SystemResult) -> None:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_stub(channel)
        await mesh_stream(stub, w.decode_prompt, 8)  # warm-up
        for _ in range(plan.repeats):
            t_call, marks, ids = await mesh_stream(stub, w.decode_prompt, plan.decode_tokens)
            decode, e2e, n = decode_rates(t_call, marks)
            result.decode_tok_s.append(decode)
            result.decode_e2e_tok_s.append(e2e)
            result.decode_tokens.append(n)
            result.decode_ids = ids


async def mesh_ttft(address: str, w: Workload, plan: Plan) -> dict[str, list[float]]:
    import grpc

    out: dict[str, list[float]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_stub(channel)
        for length, prompt in w.ttft_prompts.items():
            await mesh_stream(stub, prompt, 1)  # warm-up for this shape
            for _ in range(plan.repeats):
                t_call, marks, _ = await mesh_stream(stub, prompt, 1)
                out.setdefault(length, []).append(marks[0][0] - t_call)
    return out


async def mesh_concurrency(address: str, streams: list[tuple[list[int], int]]) -> tuple[float, int, list[str]]:
    """All streams at once on one channel; (seconds until the last is done, tokens produced, errors).
    They go in as priority -1 (the router's batch class: they may wait for a slot for minutes, not 60 s)."""
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_stub(channel)
        t = time.perf_counter()
        done = await asyncio.gather(*(mesh_stream(stub, p, n, priority=-1) for p, n in streams),
                                    return_exceptions=True)
        seconds = time.perf_counter() - t
    errors = [f"{type(d).__name__}: {d}" for d in done if isinstance(d, BaseException)]
    produced = sum(len(d[2]) for d in done if not isinstance(d, BaseException))
    return seconds, produced, errors


def kv_cache_gb(config, dtype: str, w: Workload) -> float:
    """A KV pool (it only counts bytes; pages are touched as filled) that holds every stream at once."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * DTYPE_BYTES[dtype]
    positions = sum(len(p) + n for p, n in w.streams) + max((int(k) + 1 for k in w.ttft_prompts), default=0)
    return max(0.1, 1.25 * positions * per_position / 2**30)


def start_router(mesh, address: str, model: str, prefill_chunk: int, threads: int):
    """A second router on the same stages (another prefill setting), stopped with the mesh."""
    import grpc

    from stagemesh.launcher import stage_env
    from stagemesh.v1 import router_pb2

    with grpc.insecure_channel(address) as channel:
        chains = router_stub(channel).ListChains(router_pb2.ListChainsRequest(), timeout=10).chains
    args = ["router", "--model", model, "--port", "0", "--prefill-chunk", str(prefill_chunk)]
    for chain in chains:
        args += ["--chain", ",".join(s.address for s in chain.stages)]
    return mesh.spawn(f"router-chunk{prefill_chunk}", args, stage_env(threads))


def mesh_memory(mesh, result: SystemResult) -> None:
    """Stages report their peak RSS in Stage/Info; routers are read from /proc (they are our children)."""
    import grpc

    from stagemesh.processes import peak_rss_bytes
    from stagemesh.v1 import stage_pb2, stage_pb2_grpc

    for proc in mesh.processes:
        if proc.popen.poll() is not None:
            continue
        if proc.name.startswith("stage"):
            with grpc.insecure_channel(proc.address) as channel:
                info = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)
            result.peak_rss_bytes[proc.name] = info.peak_rss_bytes
            result.weight_bytes[proc.name] = info.weight_bytes
        elif (rss := peak_rss_bytes(proc.popen.pid)) is not None:
            result.peak_rss_bytes[proc.name] = rss


def run_mesh(model: str, stages: int, replicas: int, args: argparse.Namespace, plan: Plan, w: Workload,
             config, log_dir: Path) -> SystemResult:
    from stagemesh.launcher import start_local_mesh

    started = time.perf_counter()
    result = SystemResult(f"mesh {stages}x{replicas}", stages, replicas, args.prefill_chunk)
    # --no-prefix-cache: the runs repeat their prompts, which transformers computes every time; a cache would
    # answer them (scripts/bench_prefix.py measures it). --stage-arg=--prefix-cache puts it back.
    stage_args = ["--device", args.device, "--kv-cache-gb", f"{kv_cache_gb(config, args.dtype, w):.3f}",
                  "--no-prefix-cache", *args.stage_arg]
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh, router = start_local_mesh(model, stages=stages, replicas=replicas, router_port=0, dtype=args.dtype,
                                    threads=args.stage_threads, prefill_chunk=args.prefill_chunk,
                                    extra_stage_args=stage_args, extra_router_args=args.router_arg, log_dir=log_dir,
                                    ready_timeout_s=READY_TIMEOUT_S)
    try:
        print(f"  {result.system}: up in {time.perf_counter() - started:.0f}s", flush=True)
        if replicas == 1:  # one stream uses one chain: a replica changes nothing there
            asyncio.run(mesh_decode(router.address, w, plan, result))
            result.ttft_s = asyncio.run(mesh_ttft(router.address, w, plan))
            if args.prefill_chunk:
                plain = start_router(mesh, router.address, model, 0, args.threads)
                result.ttft_nochunk_s = asyncio.run(mesh_ttft(plain.address, w, plan))
                plain.popen.terminate()
                plain.popen.wait(timeout=10)
        asyncio.run(mesh_concurrency(router.address, w.streams[:2]))  # warm-up
        for level in plan.levels:
            for _ in range(plan.concurrency_repeats):
                seconds, produced, errors = asyncio.run(mesh_concurrency(router.address, w.streams[:level]))
                result.concurrency_tok_s.setdefault(str(level), []).append(produced / seconds)
                result.concurrency_tokens.setdefault(str(level), []).append(produced)
                if errors:
                    result.concurrency_errors.setdefault(str(level), []).extend(errors)
                    print(f"  {result.system}: {len(errors)} of {level} streams failed: {errors[0]}", flush=True)
        mesh_memory(mesh, result)
    finally:
        uninterrupted(mesh.stop)  # SIGTERM to every stage and router, SIGKILL after 10 s
    result.seconds = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------------------------------
# The report


def weight_bytes_per_token(model: str, dtype: str) -> tuple[int, int]:
    """(parameters, bytes a decode step reads at the run's dtype): every parameter once, except an input embedding
    table beside its own LM head, of which a step reads one row (a tied table is read whole, as the head). Counting
    the whole table made the ~270M model's floor 14% too lenient (docs/decisions.md, "The ceiling counted a
    table no step reads")."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                shapes[name] = f.get_slice(name).get_shape()
    untied = any(name.endswith("lm_head.weight") for name in shapes)
    params = read = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        params += n
        read += shape[-1] if untied and name.endswith("embed_tokens.weight") else n
    return params, read * DTYPE_BYTES[dtype]


def ratio(b: float | None, a: float | None) -> str:
    return f"{b / a:5.2f}x" if a and b is not None else "    -"


def num(x: float | None, fmt: str) -> str:
    return format(x, fmt) if x is not None else "-"


def print_report(hf: SystemResult, meshes: list[SystemResult], w: Workload, plan: Plan, bandwidth: dict,
                 limit_tok_s: float, meta: dict) -> None:
    a = hf.medians()
    print(f"\nmodel {meta['model']} ({meta['parameters'] / 1e6:.1f}M parameters, {meta['dtype']}), "
          f"{meta['threads']} threads, {meta['cpus']} CPUs; medians of {plan.repeats} runs "
          f"({plan.concurrency_repeats} for concurrency); ratios are mesh / transformers")
    print("mesh SxR = S pipeline stages per chain, R chains (replicas); everything on the CPU")

    print(f"\n1. single-stream greedy decode, {plan.decode_prompt_tokens}-token prompt, "
          f"{plan.decode_tokens} new tokens (tokens/s; higher is better)")
    print(f"   {'system':<14} {'decode':>8} {'ratio':>7} {'end-to-end':>11} {'ratio':>7} {'of limit':>9} {'tokens':>7}")
    for r in [hf] + [m for m in meshes if m.decode_tok_s]:
        b = r.medians()
        print(f"   {r.system:<14} {b['decode_tok_s']:8.1f} {ratio(b['decode_tok_s'], a['decode_tok_s']):>7} "
              f"{b['decode_e2e_tok_s']:11.1f} {ratio(b['decode_e2e_tok_s'], a['decode_e2e_tok_s']):>7} "
              f"{b['decode_tok_s'] / limit_tok_s:9.1%} {r.decode_tokens[-1]:7d}")
    same = [m.system for m in meshes if m.decode_ids and m.decode_ids == hf.decode_ids]
    print(f"   greedy tokens identical to transformers: {', '.join(same) or 'none'}")

    lengths = list(w.ttft_prompts)
    print("\n2. time to first token (ms; lower is better); chunk = the router's --prefill-chunk")
    print(f"   {'system':<14} {'chunk':>5} " + " ".join(f"{n + ' tok':>9} {'ratio':>6}" for n in lengths))
    rows = [(hf, "-", a["ttft_s"])]
    for m in meshes:
        if m.ttft_s:
            rows.append((m, str(m.prefill_chunk), m.medians()["ttft_s"]))
        if m.ttft_nochunk_s:
            rows.append((m, "0", m.medians()["ttft_nochunk_s"]))
    for r, chunk, ttft in rows:
        cells = [f"{ttft[n] * 1e3:9.1f} {ratio(ttft[n], a['ttft_s'].get(n)):>6}" for n in lengths]
        print(f"   {r.system:<14} {chunk:>5} " + " ".join(cells))
    for n, why in w.ttft_skipped.items():
        print(f"   ({n} tokens not measured: {why})")

    print(f"\n3. aggregate tokens/s at N concurrent streams (prompts {plan.prompt_range[0]}-{plan.prompt_range[1]}, "
          f"outputs {plan.output_range[0]}-{plan.output_range[1]} tokens; transformers: one padded batch)")
    print(f"   {'system':<14} " + " ".join(f"{'N=' + str(n):>9} {'ratio':>6}" for n in plan.levels))
    for r in [hf, *meshes]:
        tps = r.medians()["concurrency_tok_s"]
        cells = [f"{num(tps.get(str(n)), '9.1f'):>9} {ratio(tps.get(str(n)), a['concurrency_tok_s'].get(str(n))):>6}"
                 for n in plan.levels]
        errors = sum(len(v) for v in r.concurrency_errors.values())
        print(f"   {r.system:<14} " + " ".join(cells) + (f"   ({errors} streams failed)" if errors else ""))

    print("\n4. peak RSS (MiB; VmHWM after all of the above)")
    print(f"   {'system':<14} {'procs':>5} {'largest':>8} {'ratio':>7} {'sum':>8} {'ratio':>7}  per process")
    for r in [hf, *meshes]:
        b = r.medians()
        per = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r.peak_rss_bytes.items())
        print(f"   {r.system:<14} {len(r.peak_rss_bytes):5d} {b['peak_rss_max_bytes'] / 2**20:8.0f} "
              f"{ratio(b['peak_rss_max_bytes'], a['peak_rss_max_bytes']):>7} {b['peak_rss_sum_bytes'] / 2**20:8.0f} "
              f"{ratio(b['peak_rss_sum_bytes'], a['peak_rss_sum_bytes']):>7}  {per}")

    print(f"\n5. batch-1 decode bound by memory bandwidth: float32 GEMV over "
          f"{bandwidth['matrix_bytes'] / 2**30:.2f} GiB with {bandwidth['threads']} threads = "
          f"{bandwidth['bytes_per_s'] / 1e9:.2f} GB/s (median of {len(bandwidth['seconds'])}, "
          f"{bandwidth.get('method', 'torch.mv')}); "
          f"{meta['weight_bytes_per_token'] / 2**20:.1f} MiB of weights read per token "
          f"-> limit {limit_tok_s:.1f} tokens/s")
    for r in [hf, *meshes]:
        if r.decode_tok_s:
            fractions = " ".join(f"{x / limit_tok_s:.0%}" for x in r.decode_tok_s)
            print(f"   {r.system:<14} {r.medians()['decode_tok_s'] / limit_tok_s:6.1%} of the limit "
                  f"(runs: {fractions})")


def plot(hf: SystemResult, meshes: list[SystemResult], plan: Plan, meta: dict, path: Path) -> None:
    """The throughput curves as a PNG, where matplotlib is installed (the dev extra; a GPU image may lack it)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in [hf, *meshes]:
        tps = r.medians()["concurrency_tok_s"]
        levels = [n for n in plan.levels if str(n) in tps]
        ax.plot(levels, [tps[str(n)] for n in levels], marker="o",
                linestyle="--" if r is hf else "-", label=r.system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(plan.levels, [str(n) for n in plan.levels])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s (median)")
    ax.set_title(f"{Path(meta['model']).name}, {meta['dtype']}, {meta['threads']} threads "
                 "(mesh SxR: stages x replicas)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.medium:
        from scripts.measure_memory import ensure_medium_model

        if not (MEDIUM_DIR / "config.json").exists():
            print(f"making a ~270M random Llama in {MEDIUM_DIR}", flush=True)
        return str(ensure_medium_model(MEDIUM_DIR))
    from stagemesh.launcher import ensure_tiny_model

    return str(ensure_tiny_model(TINY_DIR))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="local Hugging Face checkpoint (default: the tiny model)")
    which.add_argument("--medium", action="store_true", help="a ~270M Llama, made in models/llama-270m if absent")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for every side (scripts/gpu_check.sh)")
    p.add_argument("--quick", action="store_true", help="a smoke run: stages 1,2; concurrency 1,4; fewer runs")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count(),
                   help="torch threads for transformers and the GEMV (default: this machine's CPUs)")
    p.add_argument("--stage-threads", type=int, default=None,
                   help="torch threads per stage process (default: the CPUs shared among the mesh's stages)")
    p.add_argument("--stage-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for every stage, e.g. --stage-arg=--compile (repeatable)")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for the router, e.g. --router-arg=--no-repair (repeatable)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="the router's pipelined prefill chunk")
    p.add_argument("--stages", type=ints, help="override: stages per chain, e.g. 1,2,4")
    p.add_argument("--replicas", type=ints, help="override: chains, e.g. 1,2")
    p.add_argument("--levels", type=ints, help="override: concurrent streams, e.g. 1,4,16")
    p.add_argument("--repeats", type=int, help="override: runs per measurement")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--tp", type=int, default=0, metavar="K",
                   help="only the tensor-parallel rows: a TP-K stage beside one process with K threads")
    p.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def stop_on_sigterm(*_) -> None:
    raise SystemExit(143)  # unwinds through every finally: meshes and workers are stopped


def _stop_on_sigint(*_) -> None:
    # A handler of our own, not Python's default: asyncio.run then lets the KeyboardInterrupt through instead of
    # turning Ctrl-C into a cancellation of its task, which a gRPC stream can swallow.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](json.loads(args.spec.read_text()))
        args.result.write_text(json.dumps(result))
        return
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    signal.signal(signal.SIGINT, _stop_on_sigint)
    try:
        if args.tp:
            from scripts.bench_tp import run_tp_rows  # grpc and torch only for these rows, as resolve_model's

            quick = {"rounds": 3, "prompt_tokens": 64, "decode": 8} if args.quick else {}
            run_tp_rows(resolve_model(args), args.tp, device=args.device, dtype=args.dtype, out=args.out, **quick)
            return
        run_benchmark(args)
    except KeyboardInterrupt:
        print("\ninterrupted; every stage, router and worker process was stopped", file=sys.stderr)
        sys.exit(130)


def run_benchmark(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    from transformers import AutoConfig

    model = resolve_model(args)
    config = AutoConfig.from_pretrained(model, local_files_only=True)
    plan = make_plan(args)
    w = make_workload(plan, config.vocab_size, config.max_position_embeddings)
    params, bytes_per_token = weight_bytes_per_token(model, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": model, "dtype": args.dtype, "device": args.device, "stage_args": args.stage_arg,
            "router_args": args.router_arg,
            "threads": args.threads, "cpus": os.cpu_count(),
            "quick": args.quick, "parameters": params, "weight_bytes_per_token": bytes_per_token,
            "prefill_chunk": args.prefill_chunk, "plan": asdict(plan), "platform": platform.platform(),
            "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    phases: dict[str, dict[str, float]] = {}

    def phase(name: str, fn):
        """Runs one part, noting its wall time and how much of the CPUs other processes took meanwhile."""
        t, cpu = time.perf_counter(), cpu_seconds()
        out = fn()
        wall = time.perf_counter() - t
        phases[name] = {"seconds": wall, "foreign_cpu_share": foreign_share(cpu, wall)}
        return out

    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-") as tmp:
        print(f"GEMV bandwidth ({plan.gemv_gib} GiB, {args.threads} threads)", flush=True)
        gemv_spec = {"gib": plan.gemv_gib, "runs": plan.gemv_runs, "threads": args.threads, "device": args.device}
        bandwidth = phase("gemv", lambda: run_worker("gemv", gemv_spec, args.threads, Path(tmp)))

        print(f"transformers generate() on {model}", flush=True)
        spec = {"model": model, "dtype": args.dtype, "device": args.device, "threads": args.threads,
                "repeats": plan.repeats,
                "concurrency_repeats": plan.concurrency_repeats, "decode_tokens": plan.decode_tokens,
                "levels": plan.levels, "workload": asdict(w)}
        hf = SystemResult(**phase("transformers", lambda: run_worker("transformers", spec, args.threads, Path(tmp))))

    meshes = []
    for replicas in plan.replicas:
        for stages in plan.stages:
            if stages > config.num_hidden_layers:
                continue
            print(f"stagemesh, {stages} stage(s) x {replicas} replica(s)", flush=True)
            log_dir = args.out / "logs" / f"mesh-{stages}x{replicas}"
            run = partial(run_mesh, model, stages, replicas, args, plan, w, config, log_dir)
            meshes.append(phase(f"mesh {stages}x{replicas}", run))

    limit_tok_s = bandwidth["bytes_per_s"] / bytes_per_token
    meta["seconds"] = time.perf_counter() - t0
    meta["phases"] = phases
    report = {
        "meta": meta,
        "bandwidth": {**bandwidth, "weight_bytes_per_token": bytes_per_token, "decode_limit_tok_s": limit_tok_s},
        "transformers": hf.to_json(),
        "mesh": [m.to_json() for m in meshes],
        "workload": {"decode_prompt_tokens": len(w.decode_prompt), "ttft_lengths": list(w.ttft_prompts),
                     "ttft_skipped": w.ttft_skipped, "streams": [[len(p), n] for p, n in w.streams]},
    }
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    plot(hf, meshes, plan, meta, args.out / "bench.png")
    print_report(hf, meshes, w, plan, bandwidth, limit_tok_s, meta)
    busy = {k: v["foreign_cpu_share"] for k, v in phases.items() if v["foreign_cpu_share"] > 0.05}
    if busy:
        print("\nnote: other processes used the CPUs meanwhile (share of all CPU time): "
              + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()) + "; those numbers are disturbed")
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'} in {meta['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
