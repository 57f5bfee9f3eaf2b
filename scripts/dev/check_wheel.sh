#!/usr/bin/env bash
# The package as users get it (CI runs this after the suite; `make wheel-check`):
# 1. builds the sdist and the wheel, and checks the wheel's only top-level package is stagemesh and that it carries
#    the CPU kernels' C++ sources;
# 2. installs the wheel with every extra (at constraints.txt's versions) beside openai, fastapi and numpy into a
#    fresh virtual environment, and asks pip whether everything fits (pip check);
# 3. there, from outside the checkout: `stagemesh kernels` builds the CPU kernels from the wheel's own sources into a
#    fresh cache, and scripts/dev/smoke_installed.py streams tokens through a 2-stage mesh with them loaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${PYTHON:-python3.11}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

echo "== 1. sdist and wheel"
.venv/bin/python -m build --sdist --wheel --outdir "$OUT/dist" . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
WHEEL=$(ls "$OUT"/dist/*.whl)
.venv/bin/python - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert tops == {"stagemesh"}, f"top-level names besides stagemesh: {tops}"
sources = sorted(n.rsplit("/", 1)[1] for n in names if n.endswith((".cpp", ".h")))
assert sources == ["cpu_kernels.h", "decode_layers.cpp", "packed_linear.cpp", "paged_attention.cpp"], sources
assert not [n for n in names if n.startswith(("tests/", "stagemesh/tests"))], "tests in the wheel"
print(f"{sys.argv[1].rsplit('/', 1)[1]}: top level {sorted(tops)}, {len(sources)} kernel sources")
PY

echo "== 2. the wheel with every extra, beside openai, fastapi and numpy, in a fresh environment"
$PY -m venv "$OUT/venv"
"$OUT/venv/bin/pip" install --quiet -c constraints.txt torch==2.13.0
"$OUT/venv/bin/pip" install --quiet -c constraints.txt "$WHEEL[all]" openai fastapi numpy
"$OUT/venv/bin/pip" check
"$OUT/venv/bin/python" -c "import openai, fastapi, numpy, stagemesh
print('stagemesh', stagemesh.__version__, 'beside openai', openai.__version__, 'fastapi', fastapi.__version__,
      'numpy', numpy.__version__)"

echo "== 3. from outside the checkout: the installed wheel's kernels built, a 2-stage mesh with them loaded"
export XDG_CACHE_HOME="$OUT/cache"  # a cache of its own: the kernels are built from the wheel's own sources
(cd "$OUT" && "$OUT/venv/bin/stagemesh" kernels && "$OUT/venv/bin/python" "$ROOT/scripts/dev/smoke_installed.py")
echo "check_wheel: all steps passed"
