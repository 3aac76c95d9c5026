"""The fused settings against the default, on a CPU: tokens/s and peak memory of LoRA training steps.

    python bench/bench_kernels.py                 # Llama-style 4 x 512 model, 32k vocabulary, micro-batch 4 x 256
    python bench/bench_kernels.py --smoke         # tiny sizes: only checks that the path runs

Arms (one child process each, so each has its own peak RSS; the same model, batch and seed):

  default       lora.dropout=0 (the default), the chunked loss (model.fused_loss=auto on a CPU)
  dropout 0.05  the former default: peft's dropout on every adapter's input
  lora.fused    one addmm per LoRA layer (pipeline/model/kernels.py)
  fused loss    model.fused_loss's wiring with the torch fallback of the kernels' contract: on a CPU
                there is no Liger / cut-cross-entropy kernel (Triton, CUDA), so this arm computes
                full logits; it measures the wiring, not the kernels (bench/gpu_check.sh does, on a GPU)

A step is TokenLoss forward + backward + AdamW on the LoRA weights, fp32; tokens/s is the median
over the steps after the warmup; peak memory is the child's ru_maxrss (the model, the optimizer and
the step's activations, on top of the interpreter and the libraries).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ARMS = {"default": [], "dropout 0.05": ["lora.dropout=0.05"], "lora.fused": ["lora.fused=true"],
        "fused loss": ["model.fused_loss=liger"]}
SHAPES = {"full": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1376, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=32000),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}


def child(arm: str, args) -> dict:
    """One arm in this process: the steps, timed; returns its figures."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline import config as train_config
    from pipeline.model import kernels, loading
    from pipeline.model.loss import TokenLoss, collate

    torch.set_num_threads(args.threads)
    overrides = ARMS[arm]
    raw = {"model": {"path": "bench"}, "tokens": {"train_cache": "t"}, "lora": {}}
    for item in overrides:
        key, value = item.split("=")
        group, name = key.split(".")
        raw[group][name] = {"true": True}.get(value, value)
    cfg = train_config.to_typed(raw)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape], attn_implementation="sdpa"))
    model = loading.attach_lora(model, cfg).train()
    if cfg.model.fused_loss == "liger":  # the torch fallback in the kernel's place (no Triton on a CPU)
        kernels.FUSED_LOSSES["liger"] = kernels.torch_linear_cross_entropy
    loss_model = TokenLoss(model, fused_loss=cfg.model.fused_loss)
    optimizer = torch.optim.AdamW([p for _, p in loading.trainable(model)], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    records = []
    for _ in range(args.micro_batch):
        ids = torch.randint(3, vocab, (args.length,), generator=g)
        labels = ids.clone()
        labels[: args.length // 8] = -100  # a prompt
        records.append((ids, labels))
    batch = collate(records, list(range(len(records))), 0)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = loss_model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"arm": arm, "overrides": overrides, "tokens_per_s": batch.tokens / step_s, "step_s": step_s,
            "steps": len(times), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "fused_loss": getattr(loss_model.fused, "__name__", None), "final_loss": float(loss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="full")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=list(ARMS), help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    machine = C.machine()
    command = C.command_line(__file__)
    C.smoke(args, shape="tiny", micro_batch=2, length=32, steps=2, warmup=1)
    arms = []
    for arm in ARMS:
        cmd = [sys.executable, __file__, "--child", arm, "--shape", args.shape, "--micro-batch", str(args.micro_batch),
               "--length", str(args.length), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=C.child_env(), timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"arm {arm} failed:\n{proc.stderr[-4000:]}")
        arms.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = arms[0]
    versions = C.versions("torch", "transformers", "peft")
    data = {"name": "kernels", "command": command, "date": C.today(), "machine": machine, "versions": versions,
            "trainer_commit": C.git_commit(), "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
            "shape": SHAPES[args.shape], "arms": arms}
    lines = ["# Fused settings against the default (CPU, fp32, LoRA r=16 on all seven projections)", "",
             f"Command: `{command}` (from the repository root); {C.today()}.", "",
             f"Machine: {C.machine_text(machine)}. Versions: {C.versions_text(versions)}; trainer at commit "
             f"{data['trainer_commit']}.", "",
             f"Model: Llama-style {SHAPES[args.shape]}, random init; micro-batch {args.micro_batch} x {args.length} "
             f"tokens; {args.steps} steps after {args.warmup} of warmup, {args.threads} threads, one child process "
             "per arm. A step: forward, backward, AdamW on the LoRA weights.", "",
             "| arm | overrides | tokens/s (median) | vs default | peak RSS (MB) | vs default |",
             "|---|---|---:|---:|---:|---:|"]
    for a in arms:
        lines.append(f"| {a['arm']} | {' '.join(a['overrides']) or '-'} | {a['tokens_per_s']:,.0f} | "
                     f"{a['tokens_per_s'] / base['tokens_per_s']:.2f}x | {a['peak_rss_mb']:,.0f} | "
                     f"{a['peak_rss_mb'] - base['peak_rss_mb']:+,.0f} |")
    lines += ["", "The fused-loss arm runs the torch fallback in the kernel's place (no Triton kernel runs on a "
              "CPU): its figures are those of a full-logits loss, not of Liger's or cut-cross-entropy's kernels."]
    C.write_results("kernels", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
