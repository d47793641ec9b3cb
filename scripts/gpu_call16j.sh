#!/usr/bin/env bash
# Issues 15/16, device call J (through scripts/gpu_run.sh): after the params digest syncs once a step (it synced
# twice a tensor) and dynamo keeps a compiled draw per bucket: the GPU tests, `benchmarks/gpu.py --sections
# vs_trl` (TRL first in a fresh process, then detrl's GRPO step off and on), the probe on the CUDA engine. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16j.log; mkdir -p $O
log() { echo "=== $*" | tee -a "$L"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee -a "$L"
log "gpu tests"; timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | grep -v "^  \|warn" | tail -8 | tee -a "$L"
log "vs_trl ($SECONDS s in)"; timeout 240 python3 benchmarks/gpu.py --sections vs_trl --grpo-steps 5 --out $O/bench 2>&1 | grep -v "Warning\|warn\|^  \|W1201" | tr '\r' '\n' | grep -v "step/s\|^$" | tail -20 | tee -a "$L"
log "probe ($SECONDS s in)"; timeout $(( 420 - SECONDS )) python3 -m detrl.probe device=cuda trials=50 2>&1 | tail -12 | tee -a "$L"; true
