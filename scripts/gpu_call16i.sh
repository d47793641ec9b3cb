#!/usr/bin/env bash
# Issues 15/16, device call I (through scripts/gpu_run.sh): `benchmarks/gpu.py --sections targets` again, with TRL
# timed first in a fresh process under torch's default flags (call G timed it last, in the process where detrl's
# `on` run had set torch's deterministic mode and the cuBLAS workspace config), and the MoE shape's GRPO step
# (2 layers) on vs off. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16i.log; mkdir -p $O
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee -a "$L"
timeout 570 python3 benchmarks/gpu.py --sections targets --grpo-steps 4 --out $O/bench 2>&1 | grep -v "Warning\|warn\|^  \|W1201" | tr '\r' '\n' | grep -v "step/s\|^$" | tail -60 | tee -a "$L"; true
