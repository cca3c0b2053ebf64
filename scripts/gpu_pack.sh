#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that has torch, pluggy, PyYAML, numpy
# and transformers but no network: the wheels it lacks and the model file in parts. A device call
# carries at most 64 MiB, the working tree (tracked and untracked files) included, and the tree
# holds the shipped heads (~36 MiB in all), so the ~98 MB Q4_1 GGUF goes in as many parts as it
# takes for each to fit beside the tree. Everything goes into ./gpu/ (git-ignored).
#
#   scripts/gpu_pack.sh                      # here, once; it prints the calls to make
#   calls 1..N-1 (carry gpu/model.partK):    mkdir -p /tmp/specplug && cp gpu/model.part* /tmp/specplug/
#   call N (carry gpu/model.partN, gpu/wheels; each call within ~30 s of the one before, while the
#   machine is warm):                        bash scripts/gpu_check.sh --stash /tmp/specplug
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p gpu/wheels
rm -f gpu/wheels/*.whl gpu/model.part*
# pure-Python wheels of what specplug and its test run import beyond the device image, at the
# versions of this venv: gguf (the GGUF reader), jinja2 + markupsafe (chat templates), pytest + iniconfig
pkgs=$($PY -m pip freeze | grep -iE '^(gguf|jinja2|markupsafe|pytest|iniconfig)==' | tr '\n' ' ')
$PY -m pip download --no-deps --only-binary=:all: -d gpu/wheels $pkgs >/dev/null
model=$($PY -c "from specplug.runtime import resolve_model; print(resolve_model('smollm2-135m'))")
sha256sum "$model" | cut -d' ' -f1 > gpu/model.sha256
cp gpu/model.sha256 gpu/wheels/model.sha256
# what travels with every call: tracked files present and untracked files git does not ignore
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheels=$(du -cb gpu/wheels | tail -1 | cut -f1)
part=$(( 64 * 1024 * 1024 - tree - wheels - 2 * 1024 * 1024 ))  # 2 MiB to spare
[ "$part" -gt $(( 4 * 1024 * 1024 )) ] || { echo "gpu_pack: the working tree ($tree bytes) leaves no room for the model" >&2; exit 2; }
split -b "$part" -d --numeric-suffixes=1 -a 1 "$model" gpu/model.part
n=$(ls gpu/model.part* | wc -l)
echo "gpu/: $(ls gpu/wheels | grep -c whl) wheels ($(du -sh gpu/wheels | cut -f1)), the model in $n parts of at most $part bytes beside a $tree-byte tree, sha256 $(cat gpu/model.sha256)"
for k in $(seq 1 $(( n - 1 ))); do
  echo "  call $k: carry [gpu/model.part$k]: mkdir -p /tmp/specplug && cp gpu/model.part* /tmp/specplug/"
done
echo "  call $n: carry [gpu/model.part$n, gpu/wheels]: bash scripts/gpu_check.sh --stash /tmp/specplug"
