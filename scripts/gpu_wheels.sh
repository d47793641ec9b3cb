#!/usr/bin/env bash
# Download, here (any machine with pip and a registry), the wheels that detrl's train path and the GPU
# benchmark need and that the GPU image lacks, into DEST (default: ./.whl, git-ignored via .git/info/exclude).
# The image has torch 2.11, transformers 5.17, triton, numpy, pandas, pyarrow, xxhash, tqdm, accelerate 1.15,
# psutil, jinja2 (/work/.library/device/KINDS.md); it lacks hydra-core, omegaconf, antlr4, datasets (+ dill,
# multiprocess) and trl. antlr4-python3-runtime 4.9.3 is an sdist only: built into a wheel here.
set -euo pipefail
DEST=${DEST:-.whl}
PY=${PY:-python3}
mkdir -p "$DEST"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$DEST" \
  hydra-core==1.3.2 omegaconf==2.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0
tmp=$(mktemp -d)
$PY -m pip download -q --no-deps --no-binary=:all: -d "$tmp" antlr4-python3-runtime==4.9.3
$PY -m pip wheel -q --no-deps "$tmp"/antlr4-python3-runtime-4.9.3.tar.gz -w "$DEST"
rm -rf "$tmp"
ls "$DEST"
