#!/usr/bin/env bash
# Device call 4 (through scripts/gpu_run.sh): GPU tests, determinism=off divergence (tiny default model and the
# 0.6B shape with an entropy bonus, so that updates are non-zero), two determinism=on runs, the MoE shape off.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call4.log; mkdir -p /tmp/r
log() { echo "=== $*" | tee -a "$L"; }
log pytest; timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -8 | tee -a "$L"
T="device=cuda logger=none checkpoint.save_final=false"
for d in off on; do for i in 1 2; do log "tiny $d $i"; timeout 120 python3 train.py $T determinism=$d steps=20 run_dir=/tmp/r/tiny_$d$i 2>&1 | tr '\r' '\n' | tail -1 | tee -a "$L"; done
  log "divergence tiny $d"; python3 scripts/compare_runs.py /tmp/r/tiny_${d}1 /tmp/r/tiny_${d}2 2>&1 | tail -4 | tee -a "$L"; done
C="$T train_batch_size=8 rollout.n=8 micro_batch_size=64 algo.use_kl_loss=false algo.entropy_coeff=0.01 lr=1e-5"
for i in 1 2; do log "0.6B off $i"; timeout 100 python3 train.py $C model=qwen3_0p6b determinism=off steps=4 rollout.max_new_tokens=64 run_dir=/tmp/r/big_off$i 2>&1 | tr '\r' '\n' | tail -1 | tee -a "$L"; rm -rf /tmp/r/big_off$i/checkpoints; done
log "divergence 0.6B off"; python3 scripts/compare_runs.py /tmp/r/big_off1 /tmp/r/big_off2 2>&1 | tee -a "$L"
log "moe off"; timeout 150 python3 train.py $C model=qwen3_moe_a3b_6l model.num_hidden_layers=2 determinism=off steps=3 rollout.max_new_tokens=256 run_dir=/tmp/r/moe_off 2>&1 | tr '\r' '\n' | tail -2 | tee -a "$L"
for r in tiny_off1 tiny_on1 big_off1 big_off2 moe_off; do cp /tmp/r/$r/metrics.jsonl $O/m_$r.jsonl 2>/dev/null; done; true
