#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that has torch, pluggy, PyYAML, numpy
# and transformers but no network: the wheels it lacks and the model file in two halves (a device
# call carries at most 64 MiB; the Q4_1 GGUF is ~98 MB). Everything goes into ./gpu/ (git-ignored).
#
#   scripts/gpu_pack.sh                      # here, once
#   run 1 (carry gpu/model.part1):           mkdir -p /tmp/specplug && cp gpu/model.part1 /tmp/specplug/
#   run 2 (carry gpu/model.part2, gpu/wheels, within ~30 s of run 1):
#                                            bash scripts/gpu_check.sh --part1 /tmp/specplug/model.part1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p gpu/wheels
rm -f gpu/wheels/*.whl
# pure-Python wheels of what specplug and its test run import beyond the device image, at the
# versions of this venv: gguf (the GGUF reader), jinja2 + markupsafe (chat templates), pytest + iniconfig
pkgs=$($PY -m pip freeze | grep -iE '^(gguf|jinja2|markupsafe|pytest|iniconfig)==' | tr '\n' ' ')
$PY -m pip download --no-deps --only-binary=:all: -d gpu/wheels $pkgs >/dev/null
model=$($PY -c "from specplug.runtime import resolve_model; print(resolve_model('smollm2-135m'))")
size=$(stat -c %s "$model")
half=$(( (size + 1) / 2 ))
head -c "$half" "$model" > gpu/model.part1
tail -c +"$(( half + 1 ))" "$model" > gpu/model.part2
sha256sum "$model" | cut -d' ' -f1 > gpu/model.sha256
cp gpu/model.sha256 gpu/wheels/model.sha256
echo "gpu/: $(ls gpu/wheels | grep -c whl) wheels ($(du -sh gpu/wheels | cut -f1)), model halves of $half bytes, sha256 $(cat gpu/model.sha256)"
