#!/usr/bin/env bash
# Issue 16, device call E (through scripts/gpu_run.sh), after merging routing replay and the per-source switches:
# the GRPO step on vs off with the parameter sketch computed on the device (was: a host copy of the model each
# step), then the GPU tests. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16e.log; mkdir -p $O
log() { echo "=== $*" | tee -a "$L"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$L"
log "bench grpo on/off"; timeout 170 python3 benchmarks/gpu.py --sections grpo_onoff --grpo-steps 3 --out $O/bench 2>&1 | grep -v Warning | tr '\r' '\n' | grep -v "step/s" | tail -16 | tee -a "$L"
log "gpu tests ($SECONDS s in)"; timeout $(( 225 - SECONDS )) python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -12 | tee -a "$L"; true
