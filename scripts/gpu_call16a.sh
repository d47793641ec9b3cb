#!/usr/bin/env bash
# Issue 16, device call A (through scripts/gpu_run.sh): the Triton kernels' checks and timings, the GPU tests,
# then two determinism=on runs of the 0.6B shape compared step by step. Logs into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call16a.log; mkdir -p /tmp/r
log() { echo "=== $*" | tee -a "$L"; }
log env; { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u
  python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"; } 2>&1 | tee -a "$L"
log kernels; timeout 170 python3 scripts/gpu_kernels.py --out $O/kernels.json 2>&1 | tee -a "$L"
log pytest; timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -m gpu 2>&1 | tail -30 | tee -a "$L"
C="device=cuda logger=none checkpoint.save_final=false train_batch_size=8 rollout.n=8 rollout.max_batch_size=256 micro_batch_size=64 algo.use_kl_loss=false algo.entropy_coeff=0.01 lr=1e-5 rollout.max_new_tokens=256"
for i in 1 2; do log "0.6B on $i"; timeout 110 python3 train.py $C model=qwen3_0p6b determinism=on steps=10 run_dir=/tmp/r/on$i 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -3 | tee -a "$L"; rm -rf /tmp/r/on$i/checkpoints; done
log "compare 0.6B on"; python3 scripts/compare_runs.py /tmp/r/on1 /tmp/r/on2 2>&1 | tee -a "$L"
for i in 1 2; do cp /tmp/r/on$i/metrics.jsonl $O/m16_dense_on$i.jsonl 2>/dev/null; done
cp /tmp/r/on1/numerics.json $O/numerics_dense.json 2>/dev/null; true
