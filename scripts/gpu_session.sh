#!/usr/bin/env bash
# One GPU call's evidence for the paged engine core, on the device machine from the repo root:
#   bash scripts/gpu_session.sh            (wheels from scripts/gpu_wheels.sh in .whl; OUT: where results go)
# The GPU tests, then train.py device=cuda pairs (same config twice): each pair's per-step identity and
# trainer/rollout mismatch (scripts/compare_runs.py) and a summary line per run (scripts/summarize_runs.py),
# appended to $OUT as each pair ends, so a call cut off at its limit still returns the pairs it finished.
# SKIP_TESTS=1 skips the tests; T is each run's time limit in seconds; PAIRS: the pairs to run, in order (default:
# all, as listed below); RUN / DEV: a dry run on CPU.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
T=${T:-120}
mkdir -p "$OUT"
RUN=${RUN:-bash scripts/gpu_run.sh}
DEV=${DEV:-cuda}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git rev-parse HEAD; } \
  > "$OUT/device.txt" 2>&1
if [ -z "${SKIP_TESTS:-}" ]; then
  $RUN python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_preflight_wired.py tests/test_rollout_cuda_paged.py \
    tests/test_triton_paged.py tests/test_attention_chunks.py 2>&1 | tail -n 15 > "$OUT/tests.txt"
fi
pair() {  # name, then the train.py overrides shared by both runs
  local name=$1
  shift
  [[ " ${PAIRS:-$name} " == *" $name "* ]] || return 0
  for r in 0 1; do
    local t0=$SECONDS
    timeout "$T" $RUN python3 train.py device=$DEV logger=none checkpoint.save_final=false "$@" repeat=$r \
      hydra.run.dir=/tmp/runs/$name/r$r > "/tmp/runs_$name$r.log" 2>&1
    echo "$name r$r: rc $? wall $((SECONDS - t0)) s ($*)" >> "$OUT/summary.txt"
  done
  $RUN python3 scripts/summarize_runs.py /tmp/runs/$name/r0 /tmp/runs/$name/r1 >> "$OUT/summary.txt" 2>&1
  { echo "== $name ($*)"; $RUN python3 scripts/compare_runs.py /tmp/runs/$name/r0 /tmp/runs/$name/r1; } \
    >> "$OUT/compare.txt" 2>&1
}
pair qwen3_on steps=8 rollout.max_new_tokens=48
pair moe_on model=qwen3_moe steps=6 rollout.max_new_tokens=48
pair qwen3_off determinism=off steps=8 rollout.max_new_tokens=48
pair qwen3_on_partial rollout.partial.enabled=true steps=6 rollout.max_new_tokens=48
pair p6b_on model=qwen3_0p6b steps=3 train_batch_size=8 rollout.n=4 rollout.max_new_tokens=64 micro_batch_size=16
pair p6b_off determinism=off model=qwen3_0p6b steps=3 train_batch_size=8 rollout.n=4 rollout.max_new_tokens=64 micro_batch_size=16
