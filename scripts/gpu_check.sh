#!/usr/bin/env bash
# The GPU check (issue 42), for a machine with a CUDA GPU; about 9 minutes on an H100.
#
#   scripts/gpu_check.sh [--model DIR] [--out DIR] [--python PY] [--wheels DIR] [--steps 0,1,...] [--keep-going]
#                        [--dry-run]
#
# On a lent machine whose $OUT comes back, with the wheels its image lacks made here first
# (scripts/dev/gpu_wheels.sh, carried as .gpu-wheels):
#   bash scripts/gpu_check.sh --python python3 --wheels .gpu-wheels --keep-going --out "$OUT/gpu" 2>&1 | tee "$OUT/log"
# --steps splits the run over calls (step 1's model stays on a machine that stays warm). --wheels installs DIR's
# wheels into $TMPDIR/gpu-check-site (no index needed) and puts it first on PYTHONPATH for every step.
#
# 0. the device, every import the steps need, and a Triton kernel launched on it (a missing package is named);
# 1. makes a ~1.1B random Llama in bfloat16 (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads,
#    intermediate 5632, vocab 32000; stagemesh/tiny_model.py, no model hub) unless DIR holds one;
# 2. exactness on CUDA: a 2-stage chain against transformers on the same GPU, eager (--enforce-eager) and with
#    CUDA graphs (tests/test_device_exactness.py): the 1.1B model in bfloat16, the tiny Llama in float32 (1e-4);
# 3. the engine in process against the memory floor (scripts/bench_engine.py, random weights, no checkpoint): the
#    1.1B and Llama-3-8B shapes in bfloat16 with CUDA graphs: HBM bandwidth and the batch-1 floor, one session's
#    decode step, a decode pass of 32 sessions x 4,096 positions against (weights + K/V) / bandwidth, a 2,048-token
#    prompt's first token whole and in 512-token chunks, each graph bucket's capture time and memory, eager passes;
#    then the 1.1B shape once more with a layer's small ops one by one (--no-fused-layers), for what fusing gains;
# 4. the 1.1B model's decode pass in process, eager against CUDA graphs, 1, 32 and 64 sessions
#    (scripts/dev/bench_step_compile.py);
# 5. scripts/bench.py on the GPU: single-stream decode and 32/64 mixed streams, 1 and 2 stages, side by side with
#    transformers.
#
# It fails loudly: the first failing step stops it with a message naming the step (--keep-going: every step
# runs, the failed ones are named at the end and the exit status is 1). --dry-run checks the arguments and
# prints the steps without running them (what a machine without a GPU can check).
set -euo pipefail

MODEL=models/llama-1b
OUT=bench-out/gpu
PY=${PYTHON:-.venv/bin/python}
WHEELS=""
DRY=0
KEEP=0
STEPS=""
FAILED=()

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL=${2:?--model needs a directory}; shift 2 ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels needs a directory of wheels}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a list of step numbers}; shift 2 ;;
    --keep-going) KEEP=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
STEP="start"
trap 'echo "gpu_check: FAILED in step: $STEP (exit $?)" >&2' ERR
SKIP=0
step() {
  STEP=$1
  SKIP=0
  [[ -n $STEPS && ",$STEPS," != *",${STEP%%.*},"* ]] && SKIP=1
  echo; echo "== $STEP$([[ $SKIP == 1 ]] && echo ' (skipped: --steps)')"
}
run() {
  [[ $SKIP == 1 ]] && return 0
  echo "+ $*"
  [[ $DRY == 1 ]] && return 0
  if [[ $KEEP == 1 ]]; then
    "$@" || { echo "gpu_check: step failed: $STEP (exit $?); going on (--keep-going)" >&2; FAILED+=("$STEP"); }
  else
    "$@"
  fi
}

if [[ -n $WHEELS ]]; then  # before any step, whichever --steps runs (a fresh machine has none of them)
  SITE=${TMPDIR:-/tmp}/gpu-check-site
  # Every package the wheels hold, by name: pip picks the ones built for this Python from DIR alone.
  shopt -s nullglob
  FOUND=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [[ ${#FOUND[@]} -eq 0 ]]; then
    echo "gpu_check: no wheels in $WHEELS (scripts/dev/gpu_wheels.sh makes them)" >&2
    exit 2
  fi
  NAMES=($(printf '%s\n' "${FOUND[@]##*/}" | sed 's/-.*//' | sort -u))
  STEP="installing the carried wheels"  # run() before any step(): never skipped by --steps
  run "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$SITE" --upgrade "${NAMES[@]}"
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step "0. a CUDA device"
run "$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (this script is for a GPU machine; --dry-run shows its steps)")
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")'
run "$PY" -c 'import sys; sys.path.insert(0, ".")
import importlib
missing = []
for name in ("stagemesh.cli", "stagemesh.stage_server.server", "stagemesh.router.server", "transformers", "pytest",
             "pytest_asyncio", "psutil", "triton"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{name}: {type(exc).__name__}: {exc}")
if missing:
    sys.exit("gpu_check: cannot import what the steps need (carry its wheels):\n  " + "\n  ".join(missing))
from stagemesh.stage_server.gpu import triton_check
triton_check.launch("cuda")
print("imports and a Triton kernel on the GPU: ok")'

step "1. a ~1.1B random Llama in bfloat16 at $MODEL"
run "$PY" -c "import sys; sys.path.insert(0, '.')
from pathlib import Path
from stagemesh.tiny_model import make_tiny_model
if not (Path('$MODEL') / 'config.json').exists():
    make_tiny_model('$MODEL', 'llama', layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632,
                    vocab=32000, max_position=4096, dtype='bfloat16', seed=0)
print('model ready')"

step "2. exactness on CUDA: bfloat16 (1.1B) and float32 (tiny Llama) against transformers, eager and graphed"
run "$PY" -m pytest -q -s -p no:cacheprovider tests/test_device_exactness.py \
  --device cuda --test-dtype bfloat16 --test-model "$MODEL"
run "$PY" -m pytest -q -s -p no:cacheprovider tests/test_device_exactness.py --device cuda --test-dtype float32

step "3. the engine against the memory floor: 1.1B and 8B shapes, bfloat16, CUDA graphs"
run "$PY" scripts/bench_engine.py --shape 1b --shape 8b --json "$OUT/engine.json"
run "$PY" scripts/bench_engine.py --shape 1b --no-fused-layers --context 1024 --prompt-tokens 512 --repeats 10 \
  --json "$OUT/engine-unfused.json"

step "4. the 1.1B decode pass in process, eager against CUDA graphs (1, 32 and 64 sessions)"
run "$PY" scripts/dev/bench_step_compile.py --model "$MODEL" --device cuda --dtype bfloat16 --sizes 1,32,64 \
  --end 22 --passes 50 --variants eager,graphs

step "5. bench.py on the GPU: single stream, 32 and 64 mixed streams, 1 and 2 stages"
run "$PY" scripts/bench.py --model "$MODEL" --dtype bfloat16 --device cuda --stages 1,2 --replicas 1 \
  --levels 1,32,64 --repeats 1 --out "$OUT/bench"

STEP="done"
echo
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "gpu_check: failed steps: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check: all steps passed$([[ $DRY == 1 ]] && echo ' (dry run: nothing was run)')"
