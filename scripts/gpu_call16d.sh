#!/usr/bin/env bash
# Issue 16, device call D (through scripts/gpu_run.sh): two determinism=on runs of the MoE shape (2 layers, a
# smaller batch than call C to fit 10 steps), side by side, compared; then benchmarks/gpu.py --sections onoff
# (engine decode and GRPO step, on vs off, run alone on the GPU). Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16d.log; mkdir -p /tmp/r/m
log() { echo "=== $*" | tee -a "$L"; }
C="device=cuda logger=none checkpoint.save_final=false train_batch_size=4 rollout.n=8 rollout.max_batch_size=256 micro_batch_size=32 algo.use_kl_loss=false algo.entropy_coeff=0.01 lr=1e-5 rollout.max_new_tokens=32 steps=10 model=qwen3_moe_a3b_6l model.num_hidden_layers=2 determinism=on"
for i in 1 2; do timeout 200 python3 train.py $C run_dir=/tmp/r/moe_on$i > /tmp/r/moe_on$i.log 2>&1 & done; wait
for i in 1 2; do log "moe on $i"; tr '\r' '\n' < /tmp/r/moe_on$i.log | grep -v "^$" | tail -2 | tee -a "$L"; rm -rf /tmp/r/moe_on$i/checkpoints; cp /tmp/r/moe_on$i/metrics.jsonl /tmp/r/m/moe_on$i.jsonl 2>/dev/null; done
log "compare moe on"; python3 scripts/compare_runs.py /tmp/r/moe_on1 /tmp/r/moe_on2 2>&1 | tee -a "$L"
tar czf $O/metrics16d.tar.gz -C /tmp/r/m .
log "bench onoff ($SECONDS s in)"; timeout $(( 555 - SECONDS )) python3 benchmarks/gpu.py --sections onoff --grpo-steps 4 --out $O/bench 2>&1 | grep -v Warning | tail -40 | tee -a "$L"; true
