#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, fetched here for scripts/gpu_check.sh --wheels DIR to install there.
#
#   scripts/dev/gpu_wheels.sh [DIR] [PYTHON_VERSION ...]      # default: .gpu-wheels 3.12
#
# The GPU machine's image has torch, Triton, transformers and pytest but no package index; the generated stubs
# refuse an older grpcio or protobuf than the ones that made them, and the stage and router import more (psutil,
# cryptography, grpcio-health-checking, threadpoolctl, the HTTP front's fastapi, ...). This downloads the
# runtime's packages at constraints.txt's versions as binary wheels for each Python version named (about 19 MB
# for one), into DIR, which git ignores: name DIR in the device call's carry (at most 64 MiB travel per call, the
# tree included). Only what the image lacks is fetched: not torch, triton, transformers, tokenizers, numpy or
# safetensors.
set -euo pipefail

cd "$(dirname "$0")/../.."
DIR=${1:-.gpu-wheels}
shift || true
VERSIONS=("$@")
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=(3.12)
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(grpcio grpcio-reflection grpcio-health-checking protobuf prometheus-client psutil cryptography
          threadpoolctl fastapi uvicorn sse-starlette jinja2 httpx tqdm pytest-asyncio pytest-timeout)

mkdir -p "$DIR"
for version in "${VERSIONS[@]}"; do
  "$PY" -m pip download --quiet --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -c constraints.txt -d "$DIR" "${PACKAGES[@]}"
done
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR (Python ${VERSIONS[*]}): carry $DIR"
