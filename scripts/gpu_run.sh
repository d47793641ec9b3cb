#!/usr/bin/env bash
# On the GPU machine, from the repo root: install the carried wheels (scripts/gpu_wheels.sh) into /tmp/site
# and run the given command with detrl's src on the path. Every GPU run goes through here:
#   bash scripts/gpu_run.sh python train.py device=cuda model=qwen3_0p6b steps=3
#   bash scripts/gpu_run.sh python benchmarks/gpu.py kernels --out kernels.json   # sections: gpu.py --help
set -euo pipefail
WHL=${WHL:-.whl}
if [ ! -f /tmp/site/.detrl-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
  touch /tmp/site/.detrl-wheels
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 WANDB_MODE=offline
exec "$@"
