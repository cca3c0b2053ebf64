#!/usr/bin/env bash
# Training data made on a lent GPU, in the call that ran scripts/gpu_check.sh (which assembled the
# model and installed specplug under $GPU_CHECK_WORK/site). The target answers the conversation
# prompts (GPTeacher role-play and code, the target's own requests; two turns) until --until (a
# Unix time); what finished comes back as token shards (`specplug train tokens`, ~1.5 MB per
# million tokens), to be rebuilt into taps and top-k here by prefill on the CPU target:
#
#   bash scripts/gpu_datagen.sh --until $(( $(date +%s) + 200 )) --out "$OUT" [--self-s SECONDS]
#   # here: tar xzf chat-gpu-tokens.tgz; specplug train data --from-tokens chat-gpu-tokens -o DIR --taps ...
#
# The answers are the float32 GPU forward's greedy choices (weights dequantized, activations not
# quantized), so a few differ from the CPU kernels' after some tokens; the rebuild records the CPU
# target's own distributions on them, and counts the rows where its greedy choice differs.
# --self-s S first spends up to S seconds having the target write requests of its own
# (`specplug train prompts --self`, pieces of 400 candidates, each filtered against the pieces
# before it and the shipped data/train/self-smollm2*.jsonl.gz); they join the prompts, and the
# kept requests come back too (self-gpu-STAMP.jsonl.gz, to add to data/train).
# Prompts already answered in the committed conversation token folders (data/distill/*-chat*) are
# skipped (`train data --exclude`): the second GPU run, without it, answered 645 of its 845
# prompts a second time. Self-written requests use a seed of their own per run (the run's stamp),
# so a run does not sample the candidates the one before it did.
set -uo pipefail
cd "$(dirname "$0")/.."
UNTIL="" OUT="${OUT:-gpu-datagen-out}" PARALLEL=${GPU_DATAGEN_PARALLEL:-128} SELF_S=0 DEVICE=${GPU_DATAGEN_DEVICE:-cuda}
PIECE=${GPU_DATAGEN_SELF_PIECE:-200}  # candidates a piece: ~60 s on an H200 (eager, two turns); a piece cut
# off by the time limit is lost whole (the third GPU run lost its only piece of 400 at --self-s 110)
while [ $# -gt 0 ]; do
  case "$1" in
    --until) UNTIL="$2"; shift 2;;
    --out) OUT="$2"; shift 2;;
    --self-s) SELF_S="$2"; shift 2;;
    *) echo "gpu_datagen: unknown argument $1" >&2; exit 2;;
  esac
done
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-/tmp/specplug-gpu}
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DATA=$WORK/chat-gpu TOKENS=$WORK/chat-gpu-tokens
mkdir -p "$OUT" "$WORK"
UNTIL=${UNTIL:-$(( $(date +%s) + 300 ))}
STAMP=$(date -u +%Y%m%d%H%M)
shopt -s nullglob
SHIPPED_SELF=(data/train/self-smollm2*.jsonl.gz)
DONE=(data/distill/*-chat*/)  # token folders whose prompts are answered already
shopt -u nullglob
PROMPTS=(data/train/gpteacher/roleplay-simple-deduped-roleplay-instruct.json.gz
         data/train/gpteacher/codegen-instruct.json.gz "${SHIPPED_SELF[@]}")
if [ "$SELF_S" -gt 0 ]; then
  end=$(( $(date +%s) + SELF_S )); k=0
  [ "$end" -le $(( UNTIL - 120 )) ] || end=$(( UNTIL - 120 ))  # leave the answers two minutes at least
  while [ $(( end - $(date +%s) )) -gt 70 ]; do
    shopt -s nullglob; before=("$WORK"/self-*.jsonl); shopt -u nullglob
    echo "== gpu_datagen: self-written requests, piece $k"
    # candidates of this run's own seed (seed 0 made data/train/self-smollm2.jsonl.gz)
    timeout -s INT $(( end - $(date +%s) )) $PY -m specplug.cli train prompts --self "$PIECE" --offset $(( PIECE * k )) \
      --turns 2 --seed "$STAMP" --parallel "$PARALLEL" --device "$DEVICE" -o "$WORK/self-$k.jsonl" \
      --against "${SHIPPED_SELF[@]}" "${before[@]}" >> "$OUT/self.log" 2>&1 || { rm -f "$WORK/self-$k.jsonl"; break; }
    k=$(( k + 1 ))
  done
  shopt -s nullglob; pieces=("$WORK"/self-*.jsonl); shopt -u nullglob
  if [ ${#pieces[@]} -gt 0 ]; then
    SELF="$OUT/self-smollm2-gpu-$STAMP.jsonl.gz"  # a name of its own: prompt ids are "<file stem>:<line>"
    cat "${pieces[@]}" | gzip > "$SELF"
    PROMPTS+=("$SELF")
    echo "== gpu_datagen: $(zcat "$SELF" | wc -l) self-written requests kept"
  fi
fi
secs=$(( UNTIL - $(date +%s) - 30 ))  # 30 s left for the export
[ "$secs" -gt 20 ] || { echo "gpu_datagen: no time left (--until)"; exit 0; }
echo "== gpu_datagen: $secs s of generation, parallel $PARALLEL"
timeout -s INT "$secs" $PY -m specplug.cli train data --device "$DEVICE" --turns 2 --seed 11 --prompts "${PROMPTS[@]}" \
  ${DONE[@]:+--exclude "${DONE[@]}"} \
  -o "$DATA" --taps final --topk 1 --max-tokens 384 --parallel "$PARALLEL" --prefill-chunk 32 \
  --shard-prompts 50 > "$OUT/datagen.log" 2>&1
echo "== gpu_datagen: generation exit $?"
tr '\r' '\n' < "$OUT/datagen.log" | grep -v '^\s*$' | tail -4
$PY -m specplug.cli train tokens "$DATA" -o "$TOKENS" 2>&1 | tail -3
tar czf "$OUT/chat-gpu-tokens.tgz" -C "$WORK" "$(basename "$TOKENS")" && ls -la "$OUT"
