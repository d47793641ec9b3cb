#!/usr/bin/env bash
# Device call 1 (run through scripts/gpu_run.sh): environment, GPU tests, train.py on both shapes, the engine's
# throughput, and two determinism=off runs compared step by step. Logs and metrics into $OUT.
set -uo pipefail
O=${OUT:-/tmp/out}; L=$O/call1.log; mkdir -p /tmp/r
log() { echo "=== $*" | tee -a "$L"; }
log env; { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u
  python3 -c "import torch,transformers,triton,pyarrow,datasets,hydra;print(torch.__version__,transformers.__version__,triton.__version__,pyarrow.__version__,datasets.__version__,hydra.__version__)"; } 2>&1 | tee -a "$L"
log pytest; timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -25 | tee -a "$L"
C="device=cuda logger=none checkpoint.save_final=false train_batch_size=8 rollout.n=8 rollout.max_batch_size=256 micro_batch_size=64"
log train dense; timeout 240 python3 train.py $C model=qwen3_0p6b steps=3 rollout.max_new_tokens=256 run_dir=/tmp/r/dense 2>&1 | tr '\r' '\n' | tail -4 | tee -a "$L"
log train moe; timeout 240 python3 train.py $C model=qwen3_moe_a3b_6l model.num_hidden_layers=2 algo.use_kl_loss=false steps=3 rollout.max_new_tokens=256 run_dir=/tmp/r/moe 2>&1 | tr '\r' '\n' | tail -4 | tee -a "$L"
for i in 1 2; do log "off $i"; timeout 200 python3 train.py $C model=qwen3_0p6b determinism=off algo.use_kl_loss=false steps=6 rollout.max_new_tokens=64 run_dir=/tmp/r/off$i 2>&1 | tr '\r' '\n' | tail -2 | tee -a "$L"; rm -rf /tmp/r/off$i/checkpoints; done
rm -rf /tmp/r/dense/checkpoints /tmp/r/moe/checkpoints
log divergence; python3 scripts/compare_runs.py /tmp/r/off1 /tmp/r/off2 2>&1 | tee -a "$L"
for r in dense moe off1 off2; do cp /tmp/r/$r/metrics.jsonl $O/metrics_$r.jsonl 2>/dev/null; done
log engine; timeout 200 python3 benchmarks/gpu.py --sections engine --out /tmp/r/bench 2>&1 | tail -30 | tee -a "$L"
cp /tmp/r/bench/results.json $O/engine.json 2>/dev/null; true
