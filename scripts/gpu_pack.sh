#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that has torch, pluggy, PyYAML, numpy
# and transformers but no network: the wheels it lacks and the model file in parts. A device call
# carries at most 64 MiB, the working tree (tracked and untracked files) included. The tree is
# ~61 MB now (the shipped heads ~39 MB, data/ ~12 MB, docs/results ~8 MB), so the ~98 MB Q4_1
# GGUF travels in calls of their own while those folders are parked in gpu/park/ (git-ignored, so
# they do not travel), and the last call, with the tree whole again, carries only the wheels.
# Everything goes into ./gpu/.
#
#   scripts/gpu_pack.sh                      # here, once; it prints the calls to make
#   scripts/gpu_pack.sh park                 # before the part calls (the heads, data/, docs/results out)
#   calls 1..N (carry gpu/model.partK):      mkdir -p /tmp/specplug && cp gpu/model.part* /tmp/specplug/
#   scripts/gpu_pack.sh unpark               # at once after the last part (the machine stays warm 30 s)
#   call N+1 (carry gpu/wheels):             bash scripts/gpu_check.sh --stash /tmp/specplug
set -euo pipefail
cd "$(dirname "$0")/.."
PARK=(plugins/eagle3/src/specplug_eagle3/heads plugins/dflash/src/specplug_dflash/heads
      plugins/mtp/src/specplug_mtp/heads data docs/results)
case "${1:-}" in
  park)
    for p in "${PARK[@]}"; do
      [ -e "$p" ] || continue
      [ ! -e "gpu/park/$p" ] || { echo "gpu_pack: gpu/park/$p exists: unpark first" >&2; exit 2; }
      mkdir -p "gpu/park/$(dirname "$p")" && mv "$p" "gpu/park/$p"
    done
    echo "gpu_pack: parked ${PARK[*]} in gpu/park/ (scripts/gpu_pack.sh unpark puts them back)"; exit 0;;
  unpark)
    for p in "${PARK[@]}"; do
      [ -e "gpu/park/$p" ] || continue
      [ ! -e "$p" ] || { echo "gpu_pack: both $p and gpu/park/$p exist: keep one" >&2; exit 2; }
      mv "gpu/park/$p" "$p"
    done
    git status --short -- "${PARK[@]}" | grep -q '^ D' && { echo "gpu_pack: tracked files still missing" >&2; exit 2; }
    echo "gpu_pack: unparked"; exit 0;;
  "") ;;
  *) echo "gpu_pack: unknown argument $1 (none, park or unpark)" >&2; exit 2;;
esac
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
# what travels with every call: tracked files present and untracked files git does not ignore,
# once with the parked folders (the last call) and once without (the part calls)
size() { { git ls-files -z "$@"; git ls-files -z --others --exclude-standard "$@"; } \
         | { xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}'; }
tree=$(size)
slim=$(size -- . $(printf ":(exclude)%s " "${PARK[@]}"))
wheels=$(du -cb gpu/wheels | tail -1 | cut -f1)
limit=$(( 64 * 1024 * 1024 - 2 * 1024 * 1024 ))  # 2 MiB to spare
[ $(( tree + wheels )) -le "$limit" ] || { echo "gpu_pack: the whole tree ($tree bytes) and the wheels exceed a call: park more" >&2; exit 2; }
part=$(( limit - slim ))
split -b "$part" -d --numeric-suffixes=1 -a 1 "$model" gpu/model.part
n=$(ls gpu/model.part* | wc -l)
echo "gpu/: $(ls gpu/wheels | grep -c whl) wheels ($(du -sh gpu/wheels | cut -f1)), the model in $n parts of at most $part bytes beside a $slim-byte parked tree ($tree whole), sha256 $(cat gpu/model.sha256)"
echo "  here: scripts/gpu_pack.sh park"
for k in $(seq 1 "$n"); do
  echo "  call $k: carry [gpu/model.part$k]: mkdir -p /tmp/specplug && cp gpu/model.part* /tmp/specplug/"
done
echo "  here, at once: scripts/gpu_pack.sh unpark"
echo "  call $(( n + 1 )): carry [gpu/wheels]: bash scripts/gpu_check.sh --stash /tmp/specplug"
