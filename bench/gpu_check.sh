#!/usr/bin/env bash
# The GPU check of issue 32, on a bare CUDA machine, from the repository root, in two calls of under 10 minutes:
#   bash bench/gpu_wheels.sh            # first, where the package index is reachable: fills .whl/
#   bash bench/gpu_check.sh 1           # on the GPU machine (a device run: carry [".whl"], timeout ~590 s)
#   bash bench/gpu_check.sh 2           # the second call, while the machine is warm (~550 s)
#   bash bench/gpu_check.sh             # both parts, where one command may run longer
# Part 1 (each step bounded; whole logs and figures go to $OUT, default /tmp/gpu_check):
#   - the carried wheels installed into /tmp/site (the machine's torch / transformers kept); versions
#   - bench/gpu_kernels_check.py: host syncs, one compiled loss graph, lora.fused, fused losses, Liger
#     kernels, activation checkpointing through pipeline/compat.py          (~1.5 min)
#   - bench_gpu.py at the Llama-3.2-1B shape, length 2048, then 4096 (MFU by both counts) (~3 min)
#   - at 2048: the config, profiled (where the time goes), one micro-batch per update, and compiled
#     decoder layers                                                           (~4-5 min)
# Part 2:
#   - the `gpu` tests (tests/train/test_gpu.py: 13 trainer launches, one compiling) (~5-6 min)
#   - one short plan + stage on CUDA with nf4 (bench_gpu.py --smoke, model.quantization=nf4) (~2 min)
# First run on an H200 on 2026-11-26 (bench/results/gpu_check.md): part 1's steps then ran in ~370 s
# without the profile step, and the tests and nf4 steps did not finish in 120 / 75 s.
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
part=${1:-all}
if [ "$part" != 2 ]; then
step kernels 100 python3 bench/gpu_kernels_check.py --out "$O/kernels.json"
TAIL=30 step bench_1b 200 python3 bench/bench_gpu.py --seq-len 2048 4096 --micro-batch 4 --global-batch 16 \
    --steps 10 --warmup 3 --out-dir "$O"
# The levers on the fixed cost per update seen on the H200 (bench/results/gpu_check.md): where the time goes
# (profiled), one micro-batch per update instead of four (mb16: a quarter of the host's per-op work), and
# the decoder layers compiled (compiled).
TAIL=14 step levers 260 python3 bench/bench_gpu.py --seq-len 2048 --micro-batch 4 --global-batch 16 --steps 8 \
    --warmup 3 --arms config --extra-arm profiled=profile.updates=3,profile.warmup=3 \
    --extra-arm mb16=optim.micro_batch=16 --extra-arm compiled=model.compile=true --out-dir /tmp/levers
fi
if [ "$part" != 1 ]; then
step gpu_tests 380 python3 -m pytest -o addopts= -p no:cacheprovider -q -rA --durations=0 tests/train/test_gpu.py
step nf4 150 python3 bench/bench_gpu.py --smoke --override model.quantization=nf4 --out-dir /tmp/nf4
fi
exit $status
