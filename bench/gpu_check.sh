#!/usr/bin/env bash
# The GPU check of issue 32, on a bare CUDA machine, from the repository root, in calls of under 10 minutes:
#   bash bench/gpu_wheels.sh            # first, where the package index is reachable: fills .whl/
#   bash bench/gpu_check.sh 1           # on the GPU machine (a device run: carry [".whl"], timeout ~590 s)
#   bash bench/gpu_check.sh 2           # the second call, while the machine is warm (~450 s)
#   bash bench/gpu_check.sh 3           # the third (~400 s)
#   bash bench/gpu_check.sh all         # every part, where one command may run longer
# Each step is bounded; whole logs and figures go to $OUT (default /tmp/gpu_check). First the carried wheels
# are installed into /tmp/site (the machine's torch / transformers kept) and the versions printed.
# Part 1, what the H200 run of 2026-11-29 left (bench/results/gpu_check.md, where it measured packed rows through
# torch's varlen kernel at 1.6-2x the tokens/s of SDPA's masked rows, and 38.1% MFU at best):
#   - the two `tokens.torch_varlen` gpu tests: the real kernel's per-record losses against the padded batch
#     (what keeps the setting off by default), a chunked run bitwise one run                     (~2 min)
#   - 4096, the best arm (varlen, compiled layers, every fused kernel) under the profiler: where its time goes
#   - 4096, the best arm with 20 records per micro-batch (24 needed 3 layers checkpointed)        (~4 min)
#   The arms of 2026-11-29 themselves: the commands in bench/results/gpu_check.md.
# Part 2: bench/gpu_kernels_check.py (host syncs, one compiled loss graph, lora.fused, fused losses, Liger
#   kernels, activation checkpointing through pipeline/compat.py); one short plan + stage on CUDA with nf4
#   (bench_gpu.py --smoke)                                                                       (~4 min)
# Part 3: the `gpu` tests (tests/train/test_gpu.py: 15 trainer launches, one compiling)          (~6 min);
#   at 2048 with every record 2048 long (one shape per update: does a new shape cost the host?) under
#   bench/stack_sampler (where the host's time goes)                                             (~2 min)
# A bench_gpu.py arm took 55-65 s on the H200 (model built, trainer started, 8 updates); compiled ones longer.
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
ONE="--seq-len 2048 --micro-batch 16 --global-batch 16 --steps 8 --warmup 3"
SAMPLED="env PYTHONPATH=$PWD/bench/stack_sampler:$PYTHONPATH"
if [ "$part" = 1 ] || [ "$part" = all ]; then
BEST=tokens.packing=on,tokens.torch_varlen=true,model.compile=true,lora.fused=true,model.liger_kernels=true
BEST=$BEST,model.fused_loss=liger
step varlen_tests 200 python3 -m pytest -o addopts= -p no:cacheprovider -q -rA --durations=0 tests/train/test_gpu.py \
    -k torch_varlen
TAIL=30 step best_4096_profiled 140 python3 bench/bench_gpu.py --seq-len 4096 --micro-batch 16 --global-batch 16 \
    --steps 8 --warmup 3 --arms --extra-arm profiled=$BEST,profile.updates=3,profile.warmup=3 --out-dir /tmp/p4096
TAIL=30 step best_4096_mb20 140 python3 bench/bench_gpu.py --seq-len 4096 --micro-batch 20 --global-batch 20 \
    --steps 8 --warmup 3 --arms --extra-arm best=$BEST --out-dir /tmp/b4096
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
step kernels 100 python3 bench/gpu_kernels_check.py --out "$O/kernels.json"
step nf4 150 python3 bench/bench_gpu.py --smoke --override model.quantization=nf4 --out-dir /tmp/nf4
fi
if [ "$part" = 3 ] || [ "$part" = all ]; then
step gpu_tests 380 python3 -m pytest -o addopts= -p no:cacheprovider -q -rA --durations=0 tests/train/test_gpu.py
TAIL=30 step fixed_lengths 110 $SAMPLED STACK_SAMPLES="$O/samples_fixed" python3 bench/bench_gpu.py $ONE \
    --lengths fixed --out-dir /tmp/fixed
fi
exit $status
