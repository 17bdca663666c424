#!/usr/bin/env bash
# HSTU-large on ML-1M, issue 20's configurations, trained side by side on one GPU (issue 20: "where a GPU is
# available, train the large configurations there in one prepared script").
#
#   bash benchmarks/gpu_train_large.sh OUT_DIR              # on the GPU machine, from the repository root
#   DEVICE=cpu EPOCHS=1 MAX_USERS=100 VARIANTS="base noqk" bash benchmarks/gpu_train_large.sh /tmp/gtl   # a dry run
#
# Each variant is one benchmarks/reproduce_ml1m.py --models hstu-large --protocols clean process (the default
# recipe, early stopping on validation NDCG@10 with patience 10, at most $EPOCHS epochs), all started at once on
# $DEVICE; their runs share OUT_DIR/runs (each variant's flags name its own directory), their results go to
# OUT_DIR/<variant>/ml1m_hstu-large.json, their logs to OUT_DIR/<variant>.log.
#   base     the default recipe and the large preset's block (FuXi-alpha's multi-channel block), seed 42 (CPU figure:
#            benchmarks/results/ml1m_hstu-large-mc.json)
#   seed43, seed44   the same with another seed (seed-to-seed spread of the default)
#   noqk     [model] query_key_map = false (FuXi-beta's block: the channels without the semantic Q K^T one, the large
#            preset's block 2026-12-06..07; CPU figures: benchmarks/results/ml1m_hstu-large-beta*.json)
#   full     [train] softmax = full (every item a negative)
#   ffn200   [model] ffn_hidden = 200 (FuXi-alpha's second FFN stage)
#   neg512   512 uniform negatives per position (the reference's 128)
#   d64, blocks12   width (embedding_dim; d_qk = d_v = width / 2 heads) and depth (num_blocks) of the model
# SECONDS_LIMIT (default: none) stops every training after that many seconds; an unfinished run is then reported
# from its best checkpoint so far (reproduce_ml1m.py --report-only, "status": "in progress") and resumes where
# it stopped when this script runs again over the same OUT_DIR, here or there.
set -u
PY=${PY:-python3}
OUT=${1:-}
[ -n "$OUT" ] || { echo "usage: gpu_train_large.sh OUT_DIR (see the header for the variables)" >&2; exit 2; }
DEVICE=${DEVICE:-cuda}
EPOCHS=${EPOCHS:-101}
VARIANTS=${VARIANTS:-base seed43 seed44 noqk full}
DATA_DIR=${DATA_DIR:-.gpu_data/ml-1m}
SECONDS_LIMIT=${SECONDS_LIMIT:-}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
flags_of() {
  case $1 in
    base) echo "" ;;
    seed*) echo "--seed ${1#seed}" ;;
    noqk) echo "--no-query-key-map" ;;
    full) echo "--softmax full" ;;
    ffn*) echo "--ffn-hidden ${1#ffn}" ;;
    neg*) echo "--num-negatives ${1#neg}" ;;
    d[0-9]*) echo "--width ${1#d}" ;;
    blocks*) echo "--blocks ${1#blocks}" ;;
    *) echo "unknown variant $1 (base, seedN, noqk, full, ffnN, negN, dN, blocksN)" >&2; return 2 ;;
  esac
}
has_result() {  # has_result VARIANT: its result file holds a clean-protocol entry (none: the run made no checkpoint)
  grep -q '"clean"' "$OUT/$1/ml1m_hstu-large.json" 2>/dev/null
}
reproduce() {  # reproduce VARIANT EXTRA...: one reproduce_ml1m.py invocation for that variant
  local v=$1; shift
  # shellcheck disable=SC2046
  "${limit[@]}" $PY benchmarks/reproduce_ml1m.py --models hstu-large --protocols clean --device "$DEVICE" --threads 1 --epochs "$EPOCHS" \
    --data-dir "$DATA_DIR" --runs "$OUT/runs" --out "$OUT/$v" ${MAX_USERS:+--max-users "$MAX_USERS"} $(flags_of "$v") "$@"
}
for v in $VARIANTS; do flags_of "$v" >/dev/null || exit 2; done
mkdir -p "$OUT/runs"
echo "== $(date +%T) training: $VARIANTS on $DEVICE${SECONDS_LIMIT:+ for at most $SECONDS_LIMIT s}"
limit=()
[ -n "$SECONDS_LIMIT" ] && limit=(timeout --signal=TERM "$SECONDS_LIMIT")
pids=()
for v in $VARIANTS; do
  mkdir -p "$OUT/$v"
  reproduce "$v" >"$OUT/$v.log" 2>&1 &
  pids+=($!)
done
i=0
for v in $VARIANTS; do
  wait "${pids[$i]}"
  echo "   $v exit $? at $(date +%T): $(grep -c 'epoch [0-9]*/' "$OUT/$v.log") epoch lines"
  i=$((i + 1))
done
limit=()
pids=()
for v in $VARIANTS; do  # a run stopped by the limit: its best checkpoint so far, marked in progress (in parallel)
  has_result "$v" || { reproduce "$v" --report-only >>"$OUT/$v.log" 2>&1 & pids+=($!); }
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
failed=()
for v in $VARIANTS; do has_result "$v" || failed+=("$v"); done
if [ ${#failed[@]} -gt 0 ]; then echo "no result for: ${failed[*]} (see $OUT/<variant>.log)"; exit 1; fi
echo "== $(date +%T) results in $OUT/<variant>/ml1m_hstu-large.json"
