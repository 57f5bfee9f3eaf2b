#!/usr/bin/env bash
# The GPU check (issues 12 and 15), for a machine with a CUDA GPU; under ~8 minutes on an H200.
#
#   scripts/gpu_check.sh [--model DIR] [--out DIR] [--python PY] [--dry-run]
#
# 1. makes a ~1.1B random Llama in bfloat16 (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads,
#    intermediate 5632, vocab 32000; stagemesh/tiny_model.py, no model hub) unless DIR holds one;
# 2. runs the exactness test on CUDA in bfloat16 against transformers on CUDA (tests/test_device_exactness.py);
# 3. measures the HBM bandwidth (a device-to-device copy) and prints it next to the H200's 4.8 TB/s and the
#    batch-1 decode limit it sets;
# 4. runs scripts/bench.py on the GPU: single-stream decode and 32/64 mixed streams, 1 and 2 stages, side by
#    side with transformers;
# 5. decode ms/token of a 2-stage chain with --compile off and on. CUDA graphs are not implemented (README,
#    Performance): nothing to switch on.
#
# It fails loudly: the first failing step stops it with a message naming the step. --dry-run checks the
# arguments and prints the steps without running them (what a machine without a GPU can check).
# Not yet run on a GPU: no GPU was lent when it was written.
set -euo pipefail

MODEL=models/llama-1b
OUT=bench-out/gpu
PY=${PYTHON:-.venv/bin/python}
DRY=0

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL=${2:?--model needs a directory}; shift 2 ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
STEP="start"
trap 'echo "gpu_check: FAILED in step: $STEP (exit $?)" >&2' ERR
step() { STEP=$1; echo; echo "== $STEP"; }
run() { echo "+ $*"; if [[ $DRY == 0 ]]; then "$@"; fi; }

step "0. a CUDA device"
run "$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (this script is for a GPU machine; --dry-run shows its steps)")
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")'

step "1. a ~1.1B random Llama in bfloat16 at $MODEL"
run "$PY" -c "import sys; sys.path.insert(0, '.')
from pathlib import Path
from stagemesh.tiny_model import make_tiny_model
if not (Path('$MODEL') / 'config.json').exists():
    make_tiny_model('$MODEL', 'llama', layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632,
                    vocab=32000, max_position=4096, dtype='bfloat16', seed=0)
print('model ready')"

step "2. exactness on CUDA in bfloat16 against transformers on CUDA"
run "$PY" -m pytest -q -x -p no:cacheprovider tests/test_device_exactness.py \
  --device cuda --test-dtype bfloat16 --test-model "$MODEL"

step "3. HBM bandwidth"
run "$PY" -c "import sys, json, statistics, time, torch
from pathlib import Path
n = 4 * 2**30  # bytes in each buffer
src = torch.empty(n, dtype=torch.uint8, device='cuda').fill_(1)
dst = torch.empty_like(src)
times = []
for _ in range(12):
    torch.cuda.synchronize(); t = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
bw = 2 * n / statistics.median(times[2:])  # read + write
weights = sum(p.stat().st_size for p in Path('$MODEL').glob('*.safetensors'))
print(f'HBM copy bandwidth {bw / 1e12:.2f} TB/s (H200 spec: 4.8 TB/s); {weights / 2**30:.2f} GiB of weights:')
print(f'batch-1 decode limit {weights / bw * 1000:.3f} ms/token measured, {weights / 4.8e12 * 1000:.3f} at spec')"

step "4. bench.py on the GPU: single stream, 32 and 64 mixed streams, 1 and 2 stages, against transformers"
run "$PY" scripts/bench.py --model "$MODEL" --dtype bfloat16 --device cuda --stages 1,2 --replicas 1 \
  --levels 1,32,64 --repeats 2 --out "$OUT/bench"

step "5. decode ms/token, 2 stages, --compile on (compare with step 4's 2-stage single-stream decode)"
run "$PY" scripts/bench.py --model "$MODEL" --dtype bfloat16 --device cuda --stages 2 --replicas 1 \
  --levels 1 --repeats 3 --stage-arg=--compile --out "$OUT/compile"
echo "CUDA graphs: not implemented (today's attention steps each session apart; README, Performance)"

STEP="done"
echo
echo "gpu_check: all steps passed$([[ $DRY == 1 ]] && echo ' (dry run: nothing was run)')"
