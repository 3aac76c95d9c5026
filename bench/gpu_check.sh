#!/usr/bin/env bash
# The GPU check of issue 32, on a bare CUDA machine, from the repository root, in under 10 minutes:
#   bash bench/gpu_wheels.sh            # first, where the package index is reachable: fills .whl/
#   bash bench/gpu_check.sh             # on the GPU machine (a device run: carry [".whl"], timeout ~590 s)
# Steps (each bounded; figures go to $OUT, default /tmp/gpu_check):
#   1. the carried wheels installed into /tmp/site (the machine's torch / transformers kept); versions
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
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__)' 2>&1 | tee "$O/versions.log" || exit 1
# One step: bounded by its own timeout, its whole output kept in $O/NAME.log (what comes back if a later step
# hangs), its failure counted in the exit status (not lost in a pipeline's subshell).
step() {
    local name=$1 limit=$2; shift 2
    echo "== $name (at most ${limit} s)"
    timeout -k 5 "$limit" "$@" >"$O/$name.log" 2>&1; local rc=$?
    tail -n "${TAIL:-12}" "$O/$name.log"
    [ $rc -eq 0 ] || { echo "FAILED ($rc): $name"; status=1; }
}
step kernels 120 python3 bench/gpu_kernels_check.py --out "$O/kernels.json"
TAIL=30 step bench_1b 240 python3 bench/bench_gpu.py --seq-len 2048 4096 --micro-batch 4 --global-batch 16 \
    --steps 10 --warmup 3 --out-dir "$O"
step gpu_tests 120 python3 -m pytest -o addopts= -p no:cacheprovider -q -rA tests/train/test_gpu.py
step nf4 75 python3 bench/bench_gpu.py --smoke --override model.quantization=nf4 --out-dir /tmp/nf4
exit $status
