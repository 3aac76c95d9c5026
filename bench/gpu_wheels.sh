#!/usr/bin/env bash
# Run on a machine with the package index, in the repository root, before bench/gpu_check.sh: fills .whl/
# (git-ignored) with the wheels a bare GPU machine lacks (as lent here: Python 3.12, torch 2.11+cu130 with
# its triton, transformers 5.17, peft, accelerate; no hydra-core, omegaconf, bitsandbytes), for Python 3.12
# on manylinux x86-64. Liger-Kernel and cut-cross-entropy are pure Python (triton comes with CUDA torch).
# Keep the repository + .whl under the 64 MiB a device call carries (about 55 MiB with bitsandbytes).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    hydra-core==1.3.2 omegaconf==2.3.0 bitsandbytes==0.50.2 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # hydra's parser: an sdist only
du -sh .whl
