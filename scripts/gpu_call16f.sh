#!/usr/bin/env bash
# Issue 15/16, device call F (through scripts/gpu_run.sh): does the invariant gemm's tiling change bits (or only
# its K chunking)? tilings timed against cuBLAS; the GPU tests on the chunked split-K gemm; decode tok/s at
# batch 64 (off: the Triton split-K decode gemm; on) against generate. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16f.log; mkdir -p $O
log() { echo "=== $*" | tee -a "$L"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$L"
log "gemm tilings"; timeout 240 python3 scripts/gpu_gemm_tiles.py --out $O/tiles.json 2>&1 | grep -v Warning | tee -a "$L"
log "gpu tests ($SECONDS s in)"; timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu.py 2>&1 | tail -15 | tee -a "$L"
log "decode ($SECONDS s in)"; timeout 150 python3 -c "
import sys; sys.argv=['gpu']; sys.path.insert(0, 'benchmarks')
import gpu, json
from detrl.config import register_configs; register_configs()
gpu.rollout_section(gpu.DENSE, [64], gpu.NEW, 'off'); gpu.rollout_section(gpu.DENSE, [64, 256], 0, 'on')
print(json.dumps(gpu.RESULTS, indent=1))
" 2>&1 | grep -v Warning | tee -a "$L"; true
