#!/usr/bin/env bash
# The GPU check of issue 32, on a bare CUDA machine, from the repository root, in two calls of under 10 minutes:
#   bash bench/gpu_wheels.sh            # first, where the package index is reachable: fills .whl/
#   bash bench/gpu_check.sh 1           # on the GPU machine (a device run: carry [".whl"], timeout ~590 s)
#   bash bench/gpu_check.sh 2           # the second call, while the machine is warm (~450 s)
#   bash bench/gpu_check.sh 3           # the third (~400 s)
#   bash bench/gpu_check.sh all         # every part, where one command may run longer
# Each step is bounded; whole logs and figures go to $OUT (default /tmp/gpu_check). First the carried wheels
# are installed into /tmp/site (the machine's torch / transformers kept) and the versions printed.
# Part 1, the throughput questions the H200 runs of 2026-11-26 and -28 left (bench/results/gpu_check.md):
#   - bench_gpu.py at the Llama-3.2-1B shape, one micro-batch of 16 per update (the lever measured: 2.3x
#     the tokens/s of four of 4 at 2048), lengths 2048 and 4096: the headline MFU by both counts (~2.5 min)
#   - at 4096 (where the micro-batch made no difference: the GPU, not the host, was the limit), packed rows
#     under SDPA's dense block-causal mask, under flex_attention's document mask, and one flat row through
#     torch's varlen kernel (tokens.torch_varlen: no mask at all)                                (~3 min)
#   - at 2048 (where the host was the limit, a quarter of it inside SDPA's call), the same config with
#     tokens.torch_varlen                                                                        (~2 min)
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
TAIL=30 step bench_1b 170 python3 bench/bench_gpu.py --seq-len 2048 4096 --micro-batch 16 --global-batch 16 \
    --steps 8 --warmup 3 --out-dir "$O"
TAIL=30 step attention_4096 190 python3 bench/bench_gpu.py --seq-len 4096 --micro-batch 16 --global-batch 16 \
    --steps 8 --warmup 3 --arms packed --extra-arm flex=tokens.packing=on,model.attn_implementation=flex_attention \
    --extra-arm varlen=tokens.packing=on,tokens.torch_varlen=true --out-dir /tmp/attention
TAIL=30 step varlen_2048 130 python3 bench/bench_gpu.py $ONE --arms config --extra-arm varlen=tokens.torch_varlen=true \
    --out-dir /tmp/varlen
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
