#!/usr/bin/env bash
# Issue 16, device call H (through scripts/gpu_run.sh), on the kernels of call G: pairs of 10-step runs side by side
# (0.6B on, MoE on, MoE off, 0.6B off), then the probe on the CUDA engine. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16h.log; mkdir -p /tmp/r/m
log() { echo "=== $*" | tee -a "$L"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee -a "$L"
C="device=cuda logger=none checkpoint.save_final=false rollout.n=8 rollout.max_batch_size=256 algo.use_kl_loss=false algo.entropy_coeff=0.01 lr=1e-5 steps=10"
DENSE="model=qwen3_0p6b train_batch_size=8 micro_batch_size=64 rollout.max_new_tokens=64"
MOE="model=qwen3_moe_a3b_6l model.num_hidden_layers=2 train_batch_size=4 micro_batch_size=32 rollout.max_new_tokens=32"
pair() {  # name, timeout, overrides...
  local n=$1 t=$2; shift 2
  for i in 1 2; do timeout $t python3 train.py $C "$@" run_dir=/tmp/r/$n$i > /tmp/r/$n$i.log 2>&1 & done; wait
  for i in 1 2; do log "$n $i"; tr '\r' '\n' < /tmp/r/$n$i.log | grep -v "^$" | tail -2 | tee -a "$L"
    rm -rf /tmp/r/$n$i/checkpoints; cp /tmp/r/$n$i/metrics.jsonl /tmp/r/m/$n$i.jsonl 2>/dev/null; done
  log "compare $n"; python3 scripts/compare_runs.py /tmp/r/${n}1 /tmp/r/${n}2 2>&1 | tee -a "$L"
}
pair dense_on 110 $DENSE determinism=on
pair moe_on 170 $MOE determinism=on
cp /tmp/r/dense_on1/numerics.json $O/numerics_dense.json; cp /tmp/r/moe_on1/numerics.json $O/numerics_moe.json
pair moe_off 110 $MOE determinism=off
pair dense_off 90 $DENSE determinism=off
tar czf $O/metrics16h.tar.gz -C /tmp/r/m .
log "probe, CUDA engine, tiny model ($SECONDS s in)"; timeout 90 python3 -m detrl.probe device=cuda trials=50 2>&1 | grep -v "Warning\|warn\|^  " | tail -12 | tee -a "$L"
