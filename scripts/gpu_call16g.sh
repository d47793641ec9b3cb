#!/usr/bin/env bash
# Issues 15/16, device call G (through scripts/gpu_run.sh): generate alone in a fresh process (the control), the GPU
# tests, then `benchmarks/gpu.py --sections targets` (decode vs generate, on vs off engines and GRPO steps, TRL's
# step), after the split-K chunked gemm with free tiles, the fused norm+rope / silu*up / residual kernels, the
# compiled draw and the bf16 attention backward. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16g.log; mkdir -p $O
log() { echo "=== $*" | tee -a "$L"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee -a "$L"
log "generate alone, fresh process"; timeout 100 python3 benchmarks/gpu.py --sections generate --out $O/gen 2>&1 | grep -v Warning | grep "generate alone" | tee -a "$L"
log "gpu tests ($SECONDS s in)"; timeout 170 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | grep -v "^  \|warn" | tail -12 | tee -a "$L"
log "targets ($SECONDS s in)"; timeout $(( 575 - SECONDS )) python3 benchmarks/gpu.py --sections targets --grpo-steps 4 --out $O/bench 2>&1 | grep -v "Warning\|warn\|^  " | tr '\r' '\n' | grep -v "step/s\|^$" | tail -45 | tee -a "$L"; true
