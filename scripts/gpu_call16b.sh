#!/usr/bin/env bash
# Issue 16, device call B: profile determinism=on vs off (decode step, trainer logprobs fwd+bwd), dense and MoE.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16b.log
timeout 300 python3 benchmarks/gpu_profile16.py --model qwen3_0p6b 2>&1 | tee -a "$L"
timeout 250 python3 benchmarks/gpu_profile16.py --model qwen3_moe_a3b_6l --no-profile 2>&1 | tee -a "$L"
