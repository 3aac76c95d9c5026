"""GPU benchmark: tokens/s and MFU of our trainer, LoRA bf16 on a ~0.4B Llama-style model.

    python bench/bench_gpu.py                          # on a machine with a CUDA GPU
    python bench/bench_gpu.py --preset qwen2-0.5b --seq-len 2048 --micro-batch 8
    python bench/bench_gpu.py --cpu-smoke              # check the script's code path on a CPU (no figures)

Without a CUDA GPU it prints "not measured: no GPU", records that in
bench/results/gpu.json (unless a real measurement is already there) and exits 0.

What runs is our trainer itself, as the workflow launches a stage:
`torchrun --standalone --nproc-per-node 1 -m pipeline train` on a plan of one
stage, with the default trainer config (config/train: LoRA r=16, alpha=32 on
all seven Llama projections, EMA with 2 rates, AdamW, grad clip) plus
precision.mode=bf16 (bf16 autocast, frozen base weights in bf16, LoRA and EMA
in fp32). tokens/s is read from the stage's own metrics.jsonl (non-pad tokens
per update / update time), median over the updates after `--warmup`.

The model is random-init (throughput does not depend on the weights), built
from a config and saved as a Hugging Face dir; the data is a token cache of
random token ids, `--seq-len` tokens per record (no padding), the first
quarter of each record unsupervised (a prompt), as `pipeline tokenize` writes
it. The demo char tokenizer is saved with the model: the trainer only reads
its pad id.

MFU (model FLOPs utilization), documented formula:

    flops per token = 6 * N + 12 * L * d * T
    MFU = tokens/s * flops per token / peak bf16 dense FLOP/s of the GPU

N = parameters of every matmul the model runs per token (all Linear weights:
attention, MLP, LM head, and the LoRA A/B matrices; the embedding lookup is not
a matmul), L = layers, d = hidden size, T = sequence length; 12*L*d*T is the
attention score/value matmuls (PaLM appendix B; nanoGPT's estimate_mfu). 6N is
the usual forward (2N) + backward (4N: activation gradients 2N and weight
gradients 2N) convention. Under LoRA the frozen base weights get no weight
gradients, so the hardware executes about 4N + 12*L*d*T per token; that
"hardware FLOPs utilization" (HFU, 4N) is reported too, and is 2/3 of MFU's
model term. Peak: H100 SXM / H200 989 TFLOP/s, H100 PCIe 756, A100 312
(dense bf16; override with --peak-tflops).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

PRESETS = {
    # Llama-style, ~0.4B: TinyLlama-like width/depth with full multi-head attention.
    "llama-0.4b": dict(model_type="llama", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=16, intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False),
    # Qwen2-0.5B's shapes (GQA 14/2 heads, 151,936 vocab, tied embeddings).
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    # For --cpu-smoke only.
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=128, vocab_size=512, tie_word_embeddings=False),
}
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0),
               ("L40S", 362.0), ("A10G", 125.0)]
NOT_MEASURED = "not measured: no GPU"


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return value
    return None


def build_model_dir(path: Path, preset: dict, seq_len: int) -> dict:
    """Random-init model saved in bf16 with the demo tokenizer; returns the shape figures for the FLOPs count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline import demo

    tok = demo.build_tokenizer()
    spec = dict(preset)
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=max(seq_len, 2048),
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, **spec)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    info = {"params_total": sum(p.numel() for p in model.parameters()), "params_matmul": linear,
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the training process needs the GPU memory, not this one
    return info


def build_cache(path: Path, *, records: int, seq_len: int, vocab: int) -> None:
    import numpy as np

    from pipeline.data.cache import IGNORE_INDEX, write_cache

    rng = np.random.default_rng(0)
    ids = rng.integers(10, vocab, size=(records, seq_len), dtype=np.int32)
    labels = ids.copy()
    labels[:, : seq_len // 4] = IGNORE_INDEX
    write_cache(path, input_ids=ids.ravel(), labels=labels.ravel(),
                offsets=np.arange(records + 1, dtype=np.int64) * seq_len, metadata={"split": "train"})


def lora_params(info: dict, preset: dict, r: int) -> int:
    """A and B matrices of rank r on the seven Llama projections, every layer."""
    d, i = preset["hidden_size"], preset["intermediate_size"]
    kv = d * preset["num_key_value_heads"] // preset["num_attention_heads"]
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, i), (d, i), (i, d)]
    return info["layers"] * sum(r * (a + b) for a, b in shapes)


def _not_measured(out_dir: Path, command: str, machine: dict) -> None:
    print(NOT_MEASURED)
    existing = out_dir / "gpu.json"
    if existing.is_file() and json.loads(existing.read_text()).get("status") != NOT_MEASURED:
        print(f"(kept the measurement in {existing})")
        return
    data = {"name": "gpu", "status": NOT_MEASURED, "command": command, "date": C.today(), "machine": machine,
            "versions": C.versions("torch", "transformers", "peft")}
    C.write_results("gpu", ["# GPU throughput and MFU (LoRA, bf16, ~0.4B Llama-style model)", "",
                            f"{NOT_MEASURED} (last tried {C.today()} on: {C.machine_text(machine)}).", "",
                            f"Command: `{command}` on a machine with a CUDA GPU."], data, out_dir)


def main() -> None:
    machine = C.machine()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=[p for p in PRESETS if p != "tiny"], default="llama-0.4b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s of the GPU")
    ap.add_argument("--override", action="append", default=[], help="extra trainer override (Hydra), repeatable")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the code path, records nothing")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    args = ap.parse_args()
    command = C.command_line(__file__)

    import torch

    if args.cpu_smoke:
        args.preset, args.seq_len, args.micro_batch, args.global_batch, args.steps, args.warmup = "tiny", 64, 2, 4, 6, 2
    elif not torch.cuda.is_available():
        return _not_measured(args.out_dir, command, machine)
    preset = PRESETS[args.preset]
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = args.peak_tflops or peak_tflops(gpu_name)
    if peak is None and not args.cpu_smoke:
        sys.exit(f"unknown peak FLOP/s for {gpu_name!r}: pass --peak-tflops")

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        tmp = Path(tmp)
        info = build_model_dir(tmp / "model", preset, args.seq_len)
        records = args.steps * args.global_batch
        build_cache(tmp / "train.safetensors", records=records, seq_len=args.seq_len, vocab=info["vocab"])
        default = {"model": tmp / "model", "train": tmp / "train.safetensors", "val": "null"}  # no val set
        overrides = [f"optim.global_batch={args.global_batch}", f"optim.micro_batch={args.micro_batch}",
                     "checkpoint.save_every=0", *(["precision.mode=bf16"] if not args.cpu_smoke else []),
                     *args.override]
        from pipeline import config as train_config

        run = C.plan_run(tmp / "run", default, total=args.steps, overrides=overrides,
                         single_stage=True)
        cfg = train_config.load(run["config"])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "pipeline", "train", "--plan", str(run["plan"]), "--config", str(run["config"]),
               "--stage", "all", "--scratch", str(tmp / "scratch"), "--out", str(tmp / "out")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=C.child_env(), timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"training failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        rows = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r][args.warmup:]

    tps = C.median(r["tokens_per_s"] for r in rows)
    n_lora = lora_params(info, preset, cfg.lora.r)
    n = info["params_matmul"] + n_lora
    attention = 12 * info["layers"] * info["hidden"] * args.seq_len
    mfu_flops, hfu_flops = 6 * n + attention, 4 * info["params_matmul"] + 6 * n_lora + attention
    mfu = tps * mfu_flops / (peak * 1e12) if peak else None
    hfu = tps * hfu_flops / (peak * 1e12) if peak else None
    figures = {"tokens_per_s": tps, "mfu": mfu, "hfu": hfu, "peak_tflops": peak, "gpu": gpu_name,
               "step_s": C.median(r["step_time_s"] for r in rows), "mem_mb": max(r["mem_mb"] for r in rows),
               "flops_per_token_6n": mfu_flops, "flops_per_token_4n": hfu_flops, "final_loss": rows[-1]["loss"]}
    print(json.dumps({**figures, **info, "lora_params": n_lora}, indent=1))
    if args.cpu_smoke:
        print("cpu smoke run: the code path works; nothing recorded")
        return
    versions = C.versions("torch", "transformers", "peft")
    data = {"name": "gpu", "status": "measured", "command": command, "date": C.today(), "machine": machine,
            "versions": versions, "trainer_commit": C.git_commit(), "wall_s": time.time() - started,
            "settings": {**vars(args), "out_dir": str(args.out_dir), "model": {**preset, **info},
                         "lora": {"r": cfg.lora.r, "alpha": cfg.lora.alpha, "params": n_lora},
                         "ema_rates": list(cfg.ema.rates)},
            "figures": figures}
    lines = [
        "# GPU throughput and MFU (LoRA, bf16)",
        "",
        f"Command: `{command}` (from the repository root); {C.today()}.",
        "",
        f"Machine: {C.machine_text(machine)}. Versions: {C.versions_text(versions)}; "
        f"trainer at commit {data['trainer_commit']}.",
        "",
        f"Model: {args.preset}, random init, {info['params_total'] / 1e6:.0f}M parameters "
        f"({info['params_matmul'] / 1e6:.0f}M in matmuls), bf16 weights + bf16 autocast; LoRA r={cfg.lora.r} "
        f"alpha={cfg.lora.alpha} on {', '.join(cfg.lora.target_modules)} ({n_lora / 1e6:.1f}M parameters, fp32), "
        f"EMA {list(cfg.ema.rates)}. Batch {args.global_batch} x {args.seq_len} tokens per update "
        f"(micro-batch {args.micro_batch}); {args.steps} updates, the first {args.warmup} excluded.",
        "",
        "| figure | value | goal |",
        "|---|---:|---|",
        f"| tokens/s (median) | {tps:,.0f} | |",
        f"| MFU (6N + 12LdT per token, peak {peak:.0f} TFLOP/s) | {100 * mfu:.1f}% | >= 40% on H100: "
        f"{'met' if mfu >= 0.4 else 'NOT met'} |",
        f"| HFU (4N + 12LdT: LoRA's frozen weights get no weight gradients) | {100 * hfu:.1f}% | |",
        f"| step time | {figures['step_s']:.3f} s | |",
        f"| peak memory (torch.cuda.max_memory_allocated) | {figures['mem_mb'] / 1024:.1f} GiB | |",
    ]
    C.write_results("gpu", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
