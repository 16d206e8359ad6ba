#!/usr/bin/env bash
# Exercises the GPU paths in one command, on a machine with a CUDA GPU (one GPU is enough; budget 8 minutes):
#
#   bash scripts/gpu_check.sh [--out DIR]        # report: DIR/gpu_check_report.{json,txt}, default out/gpu_check
#                                                # of the checkout; a relative DIR is taken from where you run it
#
# Steps, one after the other (each one's output goes to DIR/<step>.log):
#   cuda_tests      the CUDA-gated tests (nvcc build of the staging op, the CUDA staging round trip, device
#                   path selection, op records with CUDA events);
#   op_timing       CUDA-event device times of F/B/W against the host (wall) time of the same ops;
#   one_gpu_job     4 ranks on cuda:0 (gloo, point-to-point messages staged through host memory: gloo has
#                   no CUDA point-to-point; scripts/gpu_check/on_gpu0.py), PipeMorphEngine with
#                   delegation.mode "always" (CUDA staging rings, gloo delegates) against stock DeepSpeed:
#                   losses and parameters within 1e-5; fp16 (ZeRO-1, overflowing first scale) and bf16 + ZeRO-1
#                   on 2 stages x 2 replicas, bit-identical to stock;
#   memory          4 ranks on cuda:0 as one_gpu_job (scripts/gpu_check/memory_job.py, peak_memory.py): stock
#                   DeepSpeed 1F1B, zb, adaptive and adaptive with memory.budget 1.5; per rank, an iteration's
#                   torch.cuda.max_memory_allocated less what was allocated at its start, against stock's (the
#                   default settings within 1.10x) and against the engine's prediction (peak activation
#                   micro-batches x the bytes it measured per micro-batch, plus what else the figure counts);
#   nccl_job        with 2 GPUs or more (otherwise recorded as skipped: NCCL wants one GPU per rank): one rank
#                   per GPU on the NCCL backend (scripts/gpu_check/nccl_job.py), PipeMorphEngine with direct
#                   links under NCCL's rules (delegation.mode "auto", the GPU recipe's, and "off") against
#                   stock DeepSpeed: losses and parameters within 1e-5, NcclLowering's streams run;
#   tp_job          with 4 GPUs or more (otherwise recorded as skipped): 2 stages x 2 tensor-parallel ranks, one
#                   rank per GPU on NCCL (scripts/gpu_check/tp_job.py), PipeMorphEngine (zb, 1f1b) against stock
#                   DeepSpeed on the same topology: losses and parameters within 1e-5, NcclLowering's streams run;
#   staging_bench   benchmarks/transport/staging_throughput.py, shortened;
#   nsight          where nsys is installed: an Nsight Systems capture of a 4-rank job read back by
#                   `pipemorph trace inspect` (otherwise recorded as skipped), delegated as one_gpu_job.
# Exit code: 0 when every step passed (or was skipped for want of nsys or GPUs), 1 when one failed or the budget ran
# out before one ran (verdict INCOMPLETE), 2 on bad arguments or a broken environment.
# Without a CUDA device: one line saying so, exit 0, nothing run and no report.
# PYTHON names the interpreter (default: python); GPU_CHECK_BUDGET_S the overall budget (default 480).
set -euo pipefail

PYTHON=${PYTHON:-python}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
OUT=
while [ $# -gt 0 ]; do
  case $1 in
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a directory" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    -h|--help) sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (only --out DIR)" >&2; exit 2 ;;
  esac
done
case $OUT in
  "") ;;
  /*) ;;
  *) OUT=$PWD/$OUT ;;  # relative to where the script was run, before the cd below
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu_check}

now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }  # EPOCHREALTIME is bash 5's

cuda=$("$PYTHON" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null | tail -n 1) || cuda=error
if [ "$cuda" = "False" ]; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run"
  exit 0
elif [ "$cuda" != "True" ]; then
  echo "gpu_check: '$PYTHON -c \"import torch\"' failed; nothing run" >&2
  exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The tests' extension cache, so that the staging op the tests build is the one the jobs load.
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
  TORCH_EXTENSIONS_DIR=$("$PYTHON" -c \
    'from ds_pipemorph.procs import versioned_extensions_dir; print(versioned_extensions_dir())') || {
    echo "gpu_check: '$PYTHON' cannot import ds_pipemorph (install the checkout's requirements); nothing run" >&2
    exit 2
  }
fi
export TORCH_EXTENSIONS_DIR
mkdir -p "$OUT"
STEPS=$OUT/steps.tsv
: > "$STEPS"
START=$SECONDS

row() {  # row NAME EXIT SECONDS KEYS NOTE CMD...: one line of steps.tsv (EXIT: a code, skipped or budget)
  local name=$1 rc=$2 secs=$3 keys=$4 note=$5
  shift 5
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$keys" "$note" "$*" >> "$STEPS"
}

step() {  # step NAME KEYS -- CMD...: runs CMD within what is left of the budget; its output goes to OUT/NAME.log
  local name=$1 keys=$2 left t0 rc note=""
  shift 3
  left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -le 10 ]; then
    row "$name" budget 0 "" "not run: the ${BUDGET_S} s budget was spent before this step" "$@"
    return
  fi
  echo "gpu_check: $name (at most ${left} s)"
  t0=$(now)
  set +e  # GPU_CHECK_STEP_S: the drivers give their own subprocesses what is left of it
  GPU_CHECK_STEP_S=$left timeout --kill-after=15 "$left" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  set -e
  [ "$rc" -eq 124 ] && note="timed out after ${left} s"
  row "$name" "$rc" "$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')" "$keys" "$note" "$@"
}

step cuda_tests "$OUT/cuda_tests.xml" -- "$PYTHON" -m pytest -q -rs -p no:cacheprovider -n 0 \
  --junitxml "$OUT/cuda_tests.xml" \
  tests/staging/test_staging_nvcc.py tests/staging/test_device_path.py tests/runtime/test_oprecords.py
step op_timing "$OUT/op_timing.json" -- "$PYTHON" scripts/gpu_check/op_timing.py "$OUT/op_timing.json"
step one_gpu_job "$OUT/one_gpu_job.json" -- env DS_ACCELERATOR=cuda \
  "$PYTHON" scripts/gpu_check/one_gpu_job.py "$OUT/one_gpu_job" "$OUT/one_gpu_job.json"
step memory "$OUT/memory.json" -- "$PYTHON" scripts/gpu_check/memory_job.py "$OUT/memory" "$OUT/memory.json"
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1) || gpus=0
if [ "${gpus:-0}" -ge 2 ] 2>/dev/null; then
  step nccl_job "$OUT/nccl_job.json" -- "$PYTHON" scripts/gpu_check/nccl_job.py "$OUT/nccl_job" "$OUT/nccl_job.json"
else
  row nccl_job skipped 0 "" "needs 2 CUDA devices or more (NCCL refuses two ranks of one communicator on one GPU)" \
    "$PYTHON" scripts/gpu_check/nccl_job.py "$OUT/nccl_job" "$OUT/nccl_job.json"
fi
if [ "${gpus:-0}" -ge 4 ] 2>/dev/null; then
  step tp_job "$OUT/tp_job.json" -- "$PYTHON" scripts/gpu_check/tp_job.py "$OUT/tp_job" "$OUT/tp_job.json"
else
  row tp_job skipped 0 "" "needs 4 CUDA devices or more (2 stages x 2 tensor-parallel ranks, one per GPU)" \
    "$PYTHON" scripts/gpu_check/tp_job.py "$OUT/tp_job" "$OUT/tp_job.json"
fi
step staging_bench "$OUT/staging_throughput.json" -- "$PYTHON" benchmarks/transport/staging_throughput.py \
  --sizes-mb 1 16 64 --repeats 3 --total-mb 256 --out "$OUT/staging_throughput.json"
if command -v nsys > /dev/null; then
  step nsight "$OUT/nsight.json" -- env DS_ACCELERATOR=cuda \
    "$PYTHON" scripts/gpu_check/nsight.py "$OUT/nsight" "$OUT/nsight.json"
else
  row nsight skipped 0 "" "nsys (Nsight Systems) is not installed" \
    "$PYTHON" scripts/gpu_check/nsight.py "$OUT/nsight" "$OUT/nsight.json"
fi

rc=0
"$PYTHON" scripts/gpu_check/report.py --steps "$STEPS" --out "$OUT" --budget-s "$BUDGET_S" || rc=$?
exit "$rc"
