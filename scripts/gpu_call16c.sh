#!/usr/bin/env bash
# Issue 16, device call C (through scripts/gpu_run.sh): two determinism=on and two off runs of 10 steps on the
# 0.6B shape and on the MoE shape (2 of its layers), fingerprints compared step by step. The two runs of a pair
# run side by side on the one GPU (to fit the call; bits do not depend on it). Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16c.log; mkdir -p /tmp/r/m
log() { echo "=== $*" | tee -a "$L"; }
log env; { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } 2>&1 | tee -a "$L"
C="device=cuda logger=none checkpoint.save_final=false train_batch_size=8 rollout.n=8 rollout.max_batch_size=256 micro_batch_size=64 algo.use_kl_loss=false algo.entropy_coeff=0.01 lr=1e-5 rollout.max_new_tokens=64 steps=10"
declare -A M=([dense]="model=qwen3_0p6b" [moe]="model=qwen3_moe_a3b_6l model.num_hidden_layers=2")
declare -A TO=([on]=130 [off]=80)
for d in on off; do for s in dense moe; do
  for i in 1 2; do timeout ${TO[$d]} python3 train.py $C ${M[$s]} determinism=$d run_dir=/tmp/r/${s}_$d$i > /tmp/r/${s}_$d$i.log 2>&1 & done; wait
  for i in 1 2; do log "$s $d $i"; tr '\r' '\n' < /tmp/r/${s}_$d$i.log | grep -v "^$" | tail -2 | tee -a "$L"
    rm -rf /tmp/r/${s}_$d$i/checkpoints; cp /tmp/r/${s}_$d$i/metrics.jsonl /tmp/r/m/${s}_$d$i.jsonl 2>/dev/null; done
  log "compare $s $d"; python3 scripts/compare_runs.py /tmp/r/${s}_${d}1 /tmp/r/${s}_${d}2 2>&1 | tee -a "$L"
done; done
cp /tmp/r/dense_on1/numerics.json $O/numerics_dense.json; cp /tmp/r/moe_on1/numerics.json $O/numerics_moe.json
tar czf $O/metrics16c.tar.gz -C /tmp/r/m . ; true
