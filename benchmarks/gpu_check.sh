#!/usr/bin/env bash
# The CUDA path end to end, in one prepared run on a machine with an NVIDIA GPU (issue 19, "A GPU check").
#
#   bash benchmarks/gpu_check.sh OUT_DIR                 # on the GPU machine, from the repository root
#   DEVICE=cpu EPOCHS=1 MAX_USERS=200 bash benchmarks/gpu_check.sh /tmp/gc   # the same steps on the CPU (a dry run)
#
# Steps (each logs to OUT_DIR/<step>.log; the script goes on after a failed step and exits 1 at the end;
# STEPS="device generate serve" runs those, in that order; default all six in the order below):
#   1. device    nvidia-smi, torch / triton versions, the device name (OUT_DIR/device.txt)
#   2. kernels   pytest of the Triton HSTU attention against the reference (forward and backward, relative
#                error; tests/model/test_kernels.py, test_attention_config.py) and the backend / device-graph
#                tests (CUDA graphs against eager: identical items; tests/generate/test_engine_device.py, test_graphs.py)
#   3. conformance  hstu doctor --conformance --device $DEVICE: every op the model runs against the CPU reference,
#                device graphs against eager per bucket, next-5 timed (OUT_DIR/conformance_<device>.json)
#   4. generate  benchmarks/generate.py --device $DEVICE --quick (OUT_DIR/generate_<device>.json)
#   5. train     hstu train --preset large on ML-1M ($EPOCHS epochs, clean protocol) on the device (OUT_DIR/train/)
#   6. serve     benchmarks/serve_load.py --device $DEVICE on that run, or on $SERVE_RUN when set (a run trained
#                elsewhere, so that the timed steps can run first, on a quiet GPU; OUT_DIR/serve_load_<device>.json)
#
# What the machine needs: the image's python3 with torch (and triton on CUDA); the packages of the
# project's `serve` and `test` extras that the image lacks, installed from wheels in .gpu_wheels/ when that
# folder exists (make it here with `bash benchmarks/gpu_check.sh --wheels`, for the machine's Python); ML-1M in
# $DATA_DIR (default .gpu_data/ml-1m, a copy of ../shared/data/ml-1m: ../shared does not travel).
# Results are meant to be committed under benchmarks/results/ with the device named (device.txt).
set -u
PY=${PY:-python3}
if [ "${1:-}" = "--wheels" ]; then  # here, with internet to the registries: wheels for the GPU machine's Python
  PYVER=${PYVER:-3.12}
  mkdir -p .gpu_wheels
  $PY -m pip download -q -d .gpu_wheels --only-binary=:all: --python-version "$PYVER" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 "fastapi>=0.110,<1" "uvicorn>=0.29,<1" "pydantic>=2.5,<3" "fastapi-offline>=1.7,<2" \
    "prometheus-client>=0.19,<1" "orjson>=3.9,<4" "httpx>=0.27,<1" "aiohttp>=3.9,<4" psutil safetensors tqdm hypothesis
  mkdir -p .gpu_data/ml-1m && cp ../shared/data/ml-1m/{README,movies.dat,ratings.dat,users.dat} .gpu_data/ml-1m/
  du -sh .gpu_wheels .gpu_data
  exit 0
fi
OUT=${1:-}
[ -n "$OUT" ] || { echo "usage: gpu_check.sh OUT_DIR | --wheels (see the header for the variables)" >&2; exit 2; }
DEVICE=${DEVICE:-cuda}
EPOCHS=${EPOCHS:-20}
MAX_USERS=${MAX_USERS:-}
DATA_DIR=${DATA_DIR:-.gpu_data/ml-1m}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()
step() {  # step NAME CMD...: run, log, remember a failure
  local name=$1; shift
  echo "== $name $(date +%T)"
  if ! "$@" >"$OUT/$name.log" 2>&1; then failed+=("$name"); echo "   $name FAILED (see $OUT/$name.log)"; fi
  tail -n 3 "$OUT/$name.log"
}
STEPS=${STEPS:-device kernels conformance generate train serve}
for s in $STEPS; do  # every step name checked before any step runs
  case $s in device | kernels | conformance | generate | train | serve) ;;
    *) echo "unknown step $s in STEPS (device kernels conformance generate train serve)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [ -d .gpu_wheels ] && [ "$DEVICE" != cpu ]; then  # the GPU machine's missing packages (not a CPU dry run's environment)
  step wheels $PY -m pip install -q --no-index --find-links .gpu_wheels fastapi uvicorn pydantic fastapi-offline prometheus-client orjson httpx aiohttp psutil safetensors tqdm hypothesis
fi
device_info() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "
import torch, platform
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
try:
    import triton; print('triton', triton.__version__)
except ImportError as e: print('triton: not importable:', e)
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
}
users=()
[ -n "$MAX_USERS" ] && users=(--max-users "$MAX_USERS")
SERVE_RUN=${SERVE_RUN:-$OUT/train}
for s in $STEPS; do
  case $s in
    device)
      step device device_info
      cp "$OUT/device.log" "$OUT/device.txt" ;;
    kernels)
      step kernels $PY -m pytest -q -rs tests/model/test_kernels.py tests/model/test_attention_config.py tests/backend/test_backend.py \
        tests/generate/test_engine_device.py tests/generate/test_graphs.py -p no:cacheprovider ;;
    conformance)
      step conformance $PY -m hstu.cli doctor --conformance --device "$DEVICE" --report "$OUT/conformance_$DEVICE.json" ;;
    generate)
      step generate $PY benchmarks/generate.py --device "$DEVICE" --quick --data-root "$(dirname "$DATA_DIR")" --json "$OUT/generate_$DEVICE.json" ;;
    train)
      step train $PY -m hstu.cli train --preset large --epochs "$EPOCHS" --data-dir "$DATA_DIR" --device "$DEVICE" \
        --out "$OUT/train" "${users[@]}" ;;
    serve)
      step serve $PY benchmarks/serve_load.py --run "$SERVE_RUN" --data-dir "$DATA_DIR" --device "$DEVICE" --quick \
        --json "$OUT/serve_load_$DEVICE.json" ;;
    *) echo "unknown step $s (STEPS: device kernels conformance generate train serve)"; exit 2 ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then echo "failed steps: ${failed[*]}"; exit 1; fi
echo "all steps passed; results in $OUT"
