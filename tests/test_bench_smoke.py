"""The benchmarks end to end, small: they run and write what they promise. Nothing about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEV = ROOT / "scripts" / "dev"
"""The developers' harnesses (scripts/README.md)."""
RUN_S = 900
"""Each benchmark's bound: ~1 min alone on 2 idle cores, ~3 min beside another test file (make test runs two at
once), and room for a machine several times slower."""


def test_the_bench_module_leaves_stagemesh_to_the_tree_under_test(tmp_path):
    """bench_aggregate.py imports bench.py, then runs its worker in another checkout (--code): a stagemesh bound
    on import would be this checkout's, and that tree's mesh would start with this tree's launcher."""
    probe = "import sys; sys.path.insert(0, 'scripts'); import bench; print('stagemesh' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


@pytest.mark.timeout(RUN_S + 60)
def test_bench_quick_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--repeats", "1", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"

    report = json.loads((out / "bench.json").read_text())
    assert {"meta", "bandwidth", "transformers", "mesh", "workload"} <= report.keys()
    assert report["meta"]["quick"] is True
    assert report["bandwidth"]["decode_limit_tok_s"] > 0
    systems = [report["transformers"], *report["mesh"]]
    assert [s["system"] for s in report["mesh"]] == ["mesh 1x1", "mesh 2x1"]
    for s in systems:
        assert s["decode_tok_s"] and s["concurrency_tok_s"] and s["peak_rss_bytes"], s["system"]
        assert set(s["medians"]["concurrency_tok_s"]) == {"1", "4"}
        assert not s["concurrency_errors"], s["concurrency_errors"]
    for s in report["mesh"]:
        assert s["ttft_s"].keys() == s["ttft_nochunk_s"].keys() == report["transformers"]["ttft_s"].keys()

    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1. single-stream greedy decode" in proc.stdout


@pytest.mark.timeout(RUN_S + 60)
def test_bench_router_measures_turnaround_on_both_sides(tmp_path):
    out = tmp_path / "router.json"
    proc = subprocess.run([sys.executable, str(DEV / "bench_router.py"), "--streams", "1,20",
                           "--tokens", "8", "--step-ms", "0,20", "--repeats", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = json.loads(out.read_text())["rows"]
    assert [(r["step_ms"], r["streams"]) for r in rows] == [(0, 1), (0, 20), (20, 1), (20, 20)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["stage_seen_p99_ms"] > 0 and r["router_seen_p99_le_ms"] > 0, r
        assert r["runs"][0]["tokens_per_s"] == r["tokens_per_s"]


@pytest.mark.timeout(RUN_S + 60)
def test_bench_registry_times_every_backend(tmp_path):
    out = tmp_path / "registry.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(DEV / "bench_registry.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    backends = json.loads(out.read_text())["backends"]
    assert list(backends) == ["embedded", "etcd x1", "etcd x3"]
    for name, medians in backends.items():
        assert set(medians) == {"kv_get", "kv_cas", "heartbeat", "watch_wake"} and all(
            v > 0 for v in medians.values()), name
    assert "| watch_wake |" in proc.stdout


@pytest.mark.timeout(RUN_S + 60)
def test_bench_router_measures_a_3_stage_chain(tmp_path):
    out = tmp_path / "router.json"
    proc = subprocess.run([sys.executable, str(DEV / "bench_router.py"), "--streams", "4",
                           "--tokens", "8", "--step-ms", "0", "--repeats", "1", "--stages", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = json.loads(out.read_text())["rows"]
    assert [r["stages"] for r in rows] == [3]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["router_cpu_ms_per_token"] > 0, r


@pytest.mark.timeout(RUN_S + 60)
def test_bench_network_measures_forwarding_against_its_model(tmp_path):
    out = tmp_path / "network.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_network.py"), "--stages", "2",
                           "--delays-ms", "0,2", "--tokens", "6", "--repeats", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = json.loads(out.read_text())["rows"]
    assert [(r["stages"], r["delay_ms"]) for r in rows] == [(2, 0), (2, 2)]
    for r in rows:
        assert r["forwarding_ms"] > 0 and r["forwarding_model_ms"] > 0, r


@pytest.mark.timeout(2 * RUN_S + 60)
def test_bench_floor_runs_each_tree_in_its_own_checkout_and_sets_them_side_by_side(tmp_path):
    """--code twice (this checkout, twice: the runs of a before/after comparison), one round: each run is the
    tree's own bench_floor.py, its report kept (the wire, the tiny chain against transformers, where a step's time
    goes), and the summary gives each figure per tree with its ratio to the first's."""
    proc = subprocess.run([sys.executable, str(DEV / "bench_floor.py"), "--quick", "--code", str(ROOT),
                           "--code", str(ROOT), "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=2 * RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    reports = sorted(tmp_path.glob("*/floor.json"))
    assert [r.parent.name for r in reports] == [f"0-{ROOT.name}-0", f"1-{ROOT.name}-0"]
    summary = proc.stdout.split("medians of 1 run(s) per tree")[1]
    chain = summary.split("tiny 2 stage(s) x 1 thread(s)\n")[1].splitlines()[:2]
    assert [line.split()[0] for line in chain] == [str(ROOT), str(ROOT)]
    assert chain[0].endswith("1.00x") and chain[1].endswith("x")

    report = json.loads(reports[0].read_text())  # what one tree's run reports: the wire, the chain, its breakdown
    assert [(r["tokens"], r["hidden"]) for r in report["wire"]] == [(1, 256), (1, 1024), (256, 1024)]
    hf, (tiny_chain,) = report["tiny"]["transformers"], report["tiny"]["chains"]
    assert hf["ms_per_token"] > 0 and tiny_chain["ms_per_token"] > 0
    assert tiny_chain["ids"] == hf["ids"]  # the same greedy tokens
    first, last = tiny_chain["breakdown_us"]["0:4"], tiny_chain["breakdown_us"]["4:8"]
    assert first["model"] > 0 and last["model"] > 0 and last["sample"] > 0


def test_gpu_check_parses_its_arguments_and_dry_runs():
    """It cannot run here (no GPU); its syntax, arguments and steps can be checked."""
    script = str(ROOT / "scripts" / "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    dry = subprocess.run([script, "--dry-run", "--model", "/tmp/nowhere"], capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert "--device cuda --test-dtype bfloat16 --test-model /tmp/nowhere" in dry.stdout
    assert "all steps passed (dry run" in dry.stdout
    bad = subprocess.run([script, "--no-such-flag"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr
    some = subprocess.run([script, "--dry-run", "--steps", "0,3"], capture_output=True, text=True, timeout=30)
    assert some.returncode == 0 and "bench_engine.py" in some.stdout and "test_device_exactness" not in some.stdout
    assert "== 2. exactness on CUDA" in some.stdout and "(skipped: --steps)" in some.stdout


def test_gpu_check_installs_the_carried_wheels_by_name_from_their_folder_alone(tmp_path):
    """--wheels: the GPU machine has no package index; pip takes each package the folder holds from it."""
    script = str(ROOT / "scripts" / "gpu_check.sh")
    for wheel in ("grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.whl", "grpcio-1.85.1-cp311-cp311-any.whl",
                  "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl"):
        (tmp_path / wheel).write_bytes(b"")
    dry = subprocess.run([script, "--dry-run", "--steps", "0", "--wheels", str(tmp_path)], capture_output=True,
                         text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    install = next(line for line in dry.stdout.splitlines() if "pip install" in line)
    assert f"--no-index --find-links {tmp_path}" in install and install.endswith(" grpcio protobuf")
    empty = tmp_path / "empty"
    empty.mkdir()
    none = subprocess.run([script, "--steps", "0", "--wheels", str(empty)], capture_output=True, text=True, timeout=30)
    assert none.returncode == 2 and "no wheels in" in none.stderr


@pytest.mark.timeout(RUN_S + 60)
def test_bench_tp_rows_measure_both_layouts(tmp_path, tiny_model):
    out = tmp_path / "bench-tp"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--tp", "2", "--quick", "--model",
                           str(tiny_model), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((out / "bench_tp.json").read_text())
    assert report["tp"] == 2 and len(report["layouts"]) == 2
    for layout in report["layouts"].values():
        assert layout["prefill"] > 0 and layout["decode"] > 0
    assert "TP / one process" in proc.stdout


@pytest.mark.timeout(RUN_S + 60)
def test_bench_aggregate_runs_each_arm_and_reports_its_ratio_to_the_first(tmp_path, tiny_model):
    """One tree as it is and again with more stage flags (--also-with): two arms, the first the baseline."""
    proc = subprocess.run([sys.executable, str(DEV / "bench_aggregate.py"), "--model", str(tiny_model),
                           "--levels", "2", "--repeats", "1", "--warmup", "0", "--stages", "1", "--code", str(ROOT),
                           "--also-with=--no-packed-weights"],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    rows = [i for i, line in enumerate(lines) if line.strip().startswith("2 streams")]
    assert len(rows) == 2 and " 1.00x, first token " in lines[rows[0]], proc.stdout
    assert all(line.endswith(")") and "p90" in line for line in (lines[r] for r in rows)), proc.stdout
    assert lines[rows[1] - 1].strip().endswith("--no-packed-weights"), proc.stdout


@pytest.mark.timeout(RUN_S + 60)
def test_bench_prefix_compares_the_cache_off_and_on_with_the_same_tokens(tmp_path, tiny_model):
    out = tmp_path / "prefix.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prefix.py"), "--model", str(tiny_model),
                           "--stages", "1", "--system", "64", "--user", "8", "--new", "2", "--requests", "3",
                           "--concurrent", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["same_tokens"] and report["off"]["prefix_hit_positions"] == [0]
    assert report["on"]["prefix_hit_positions"] == [4 * 64]  # the 2nd, 3rd and both concurrent requests
    assert "median TTFT of the rest" in proc.stdout


@pytest.mark.timeout(RUN_S + 60)
def test_bench_linear_checks_and_times_every_arm():
    """Small shapes, uneven (a last panel padded, odd features): each arm checked against float64, then a row per
    M with the three arms and MKL's ratio to the packed kernel."""
    proc = subprocess.run([sys.executable, str(DEV / "bench_linear.py"), "--hidden", "40",
                           "--intermediate", "52", "--layers", "1", "--rows", "1,7", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(" ")]  # the header starts at 0
    assert [r[0] for r in rows] == ["M", "1", "7"], proc.stdout
    assert all(len(r) == 5 and r[-1].endswith("x") for r in rows[1:]), proc.stdout


def test_bench_hop_times_both_transports_side_by_side():
    proc = subprocess.run([sys.executable, str(DEV / "bench_hop.py"), "--sizes", "256,4096",
                           "--rounds", "2", "--n", "20"], cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["256", "4096"], proc.stdout
    assert all(float(r[4]) > 0 and float(r[6]) > 0 and r[7].endswith("x)") for r in rows), proc.stdout


@pytest.mark.timeout(RUN_S + 60)
def test_bench_attention_times_the_kernel_in_both_cases_for_both_shapes():
    """This checkout's kernel, in a process of its own (as each tree's must be), two rounds: both cases of both head
    shapes timed, each figure with its ratio to the first tree's."""
    proc = subprocess.run([sys.executable, str(DEV / "bench_attention.py"), "--code", str(ROOT),
                           "--sessions", "3", "--context", "40", "--runs", "3", "--rounds", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.splitlines()[-1])
    (figures,) = report["medians"].values()
    assert {f"{shape} {case} ms" for shape in ("tiny", "270m") for case in ("scattered", "resident")} <= figures.keys()
    assert all(value > 0 for value in figures.values())
    assert proc.stdout.count("1.00x\n") == 12, proc.stdout  # ms, GB/s and ns of 2 shapes x 2 cases, each with its ratio


@pytest.mark.timeout(RUN_S + 60)
def test_bench_pass_times_each_weight_layout_side_by_side(tiny_model):
    """--weights: a copy of the model per layout (as loaded, packed panels with the norms apart, packed as a stage
    holds them), passes alternated; a time per layout and size in the JSON."""
    proc = subprocess.run([sys.executable, str(DEV / "bench_pass.py"), "--model", str(tiny_model),
                           "--sizes", "1,3", "--passes", "5", "--context", "40", "--weights", "torch,panels,packed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    times = json.loads(proc.stdout.splitlines()[-1])["ms_per_pass"]
    assert sorted(times) == sorted(f"{b}/{w}" for b in (1, 3) for w in ("torch", "panels", "packed"))
    assert all(ms > 0 for ms in times.values())


def test_bytes_per_token_count_one_row_of_an_untied_embedding_and_all_of_a_tied_one(tmp_path):
    from safetensors import safe_open

    from scripts.bench import weight_bytes_per_token
    from stagemesh.tiny_model import make_tiny_model

    for tied in (False, True):
        model = make_tiny_model(tmp_path / str(tied), layers=2, tie_word_embeddings=tied)
        with safe_open(str(model / "model.safetensors"), framework="pt") as f:
            table = f.get_slice("model.embed_tokens.weight").get_shape()
        params, read = weight_bytes_per_token(str(model), "float32")
        unread = 0 if tied else (table[0] - 1) * table[1]
        assert read == (params - unread) * 4


def test_bench_engine_reports_every_figure_against_its_floor(tmp_path):
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--shape", "tiny", "--device",
                           "cpu", "--dtype", "float32", "--quick", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [report] = json.loads(out.read_text())
    assert report["floor_ms"] > 0 and report["single_stream_ms"] > 0 and report["batch"]["floor_ms"] > 0
    assert report["prompt"]["tokens"] == 128 and report["prompt"]["chunked_ms"] > 0
    assert report["attention"] == "cpu kernel" and report["eager_passes"] == 0
    assert "one session's decode step" in proc.stdout
