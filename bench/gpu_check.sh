#!/usr/bin/env bash
# The GPU check of issue 32, on a bare CUDA machine, from the repository root, in two calls of under 10 minutes:
#   bash bench/gpu_wheels.sh            # first, where the package index is reachable: fills .whl/
#   bash bench/gpu_check.sh 1           # on the GPU machine (a device run: carry [".whl"], timeout ~590 s)
#   bash bench/gpu_check.sh 2           # the second call, while the machine is warm (~450 s)
#   bash bench/gpu_check.sh 3           # the third (~400 s)
#   bash bench/gpu_check.sh all         # every part, where one command may run longer
# Each step is bounded; whole logs and figures go to $OUT (default /tmp/gpu_check). First the carried wheels
# are installed into /tmp/site (the machine's torch / transformers kept) and the versions printed.
# Part 1, what the H200 runs of 2026-11-26 and -28 left (bench/results/gpu_check.md): at one micro-batch of 16
# per update (2.3x the tokens/s of four of 4 at 2048), packed rows through torch's varlen kernel
# (tokens.torch_varlen: one flat row, no mask; SDPA's dense block-causal mask and its host time are gone):
#   - 2048: the config (packed rows under SDPA) against varlen, then varlen with the decoder layers compiled and
#     every fused kernel (the 17.7% arm of 2026-11-28, plus varlen)                             (~4 min)
#   - 4096 (where the GPU, not the host, was the limit at 15%): varlen, and varlen with the fused kernels (~3 min)
#   - 2048 with 32 records per update in one micro-batch: the fixed cost per update over twice the tokens (~1 min)
# Part 2: the decoder layers compiled with the fused kernels (2048); bench/gpu_kernels_check.py (host syncs,
#   one compiled loss graph, lora.fused, fused losses, Liger kernels, activation checkpointing through
#   pipeline/compat.py); one short plan + stage on CUDA with nf4 (bench_gpu.py --smoke)           (~7 min)
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
VARLEN=tokens.packing=on,tokens.torch_varlen=true
BEST=model.compile=true,lora.fused=true,model.liger_kernels=true,model.fused_loss=liger
TAIL=30 step varlen_2048 150 python3 bench/bench_gpu.py $ONE --arms config --extra-arm varlen=$VARLEN \
    --out-dir /tmp/v2048
TAIL=30 step best_2048 120 python3 bench/bench_gpu.py $ONE --arms --extra-arm best=$VARLEN,$BEST --out-dir /tmp/b2048
TAIL=30 step varlen_4096 85 python3 bench/bench_gpu.py --seq-len 4096 --micro-batch 16 --global-batch 16 --steps 8 \
    --warmup 3 --arms --extra-arm varlen=$VARLEN --out-dir /tmp/v4096
TAIL=30 step best_4096 120 python3 bench/bench_gpu.py --seq-len 4096 --micro-batch 16 --global-batch 16 --steps 8 \
    --warmup 3 --arms --extra-arm best=$VARLEN,$BEST --out-dir /tmp/b4096
TAIL=30 step varlen_2048_mb32 80 python3 bench/bench_gpu.py --seq-len 2048 --micro-batch 32 --global-batch 32 \
    --steps 8 --warmup 3 --arms --extra-arm varlen=$VARLEN --out-dir /tmp/v2048b
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
TAIL=30 step compiled 160 python3 bench/bench_gpu.py $ONE --arms config \
    --extra-arm best=model.compile=true,lora.fused=true,model.liger_kernels=true,model.fused_loss=liger \
    --out-dir /tmp/compiled
step kernels 100 python3 bench/gpu_kernels_check.py --out "$O/kernels.json"
step nf4 150 python3 bench/bench_gpu.py --smoke --override model.quantization=nf4 --out-dir /tmp/nf4
fi
if [ "$part" = 3 ] || [ "$part" = all ]; then
step gpu_tests 380 python3 -m pytest -o addopts= -p no:cacheprovider -q -rA --durations=0 tests/train/test_gpu.py
TAIL=30 step fixed_lengths 110 $SAMPLED STACK_SAMPLES="$O/samples_fixed" python3 bench/bench_gpu.py $ONE \
    --lengths fixed --out-dir /tmp/fixed
fi
exit $status
