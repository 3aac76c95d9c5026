#!/usr/bin/env bash
# The GPU check of issue 32, on a bare CUDA machine, from the repository root, in under 10 minutes:
#   bash bench/gpu_wheels.sh            # first, where the package index is reachable: fills .whl/
#   bash bench/gpu_check.sh             # on the GPU machine (a device run: carry [".whl"], timeout ~590 s)
# Steps (each bounded; figures go to $OUT, default /tmp/gpu_check):
#   1. versions; the carried wheels installed into /tmp/site (the machine's torch / transformers kept)
#   2. bench/gpu_kernels_check.py: host syncs, one compiled loss graph, lora.fused, fused losses, Liger
#      kernels, activation checkpointing through pipeline/compat.py          (~1.5 min)
#   3. bench_gpu.py at the Llama-3.2-1B shape, length 2048, then 4096 (MFU by both counts) (~4 min)
#   4. one short plan + stage on CUDA with nf4 (bench_gpu.py --smoke, model.quantization=nf4) (~1 min)
#   5. the `gpu` tests (tests/train/test_gpu.py)                                (~2 min)
# Never run here so far: no GPU was lent to the session that wrote it.
set -o pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/gpu_check}; mkdir -p "$O"
status=0
nvidia-smi -L || exit 1
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__)' || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
step() { echo "== $1"; shift; "$@" || { echo "FAILED ($?): $*"; status=1; }; }
step kernels timeout 150 python3 bench/gpu_kernels_check.py --out "$O/kernels.json" 2>&1 | tee "$O/kernels.log"
step "bench_gpu 1B" timeout 270 python3 bench/bench_gpu.py --seq-len 2048 4096 --micro-batch 4 --global-batch 16 \
    --steps 10 --warmup 3 --out-dir "$O/bench" 2>&1 | tail -25
step "nf4 plan + stage" timeout 120 python3 bench/bench_gpu.py --smoke --override model.quantization=nf4 \
    --out-dir "$O/nf4" 2>&1 | tail -8
step "gpu tests" timeout 170 python3 -m pytest -o addopts= -p no:cacheprovider -q -rA tests/train/test_gpu.py 2>&1 \
    | tee "$O/pytest.log" | tail -15
exit $status
